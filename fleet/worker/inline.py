"""The sequential shortcut: a task that finishes a step of a sequential run executes
the run's next step itself, with no broker round trip and no second read.

The only module that knows of it. Once a step's body has run, and while the task may
go on (``inline_steps`` steps, ``INLINE_SECONDS`` if others wait for a slot, no shutdown
begun), the step's commit transaction also takes the lease of the run's next step if
the replay recorded exactly one; that step is then not sent but run here. A step kept
so is in the store already: if this process dies before taking it (or while running
it), the sweeper sends it.
Fan-outs are still sent, one message per item, so that any worker can take them.
An async step's attempt may go on off its slot, as a greenlet on a strand
(``fleet/worker/strands.py``), with the run's next steps while they are async too.

An advance (a new run's first, a waiting run's resume when its signal came or its
timer fired, a fan-in's wake-up) does the same with the first task step its replay
recorded (``advance_steps``): the replay and that step's lease are one transaction
(the run started or resumed, its next steps recorded, the run marked advanced, the
lease taken at the COMMIT), the others are sent once it has committed, and that one
runs here. The replay has recorded it in the store already, so the sweeper sends it if
this process dies first; a message for it that is also delivered drops itself on the
live lease. A step naming limits is sent (it takes room before its lease).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from celery.worker import state as worker_state

from fleet.errors import StoreUnavailable
from fleet.logs import log_context
from fleet.registry import is_async
from fleet.store.engine import CommitUnknown
from fleet.store.ledger import Lease, TakeRefused
from fleet.store.rows import RunRow
from fleet.worker import process, strands
from fleet.worker.attempt import commit, perform, running, take
from fleet.worker.context import Attempt
from fleet.worker.failures import refused
from fleet.worker.replay import Replayed, replay_run
from fleet.worker.runtime import Runtime
from fleet.worker.workflow import NewTask

log = logging.getLogger("fleet.replay")

# However many steps ``inline_steps`` allows, a task hands the run back to the queue
# after this long if others wait for a slot (messages on the worker's queues, or tasks
# this worker took and has not started), so one long run does not keep a slot from
# them; if none wait it keeps the slot and looks again this much later. A hand-back
# costs a message through the worker's one consumer thread: 500 runs handing back every
# 5 s with nothing waiting queued each other's for 2 s (bench.async_steps, c=500).
# A run going on on a strand holds no slot, and is not handed back for others.
INLINE_SECONDS = 5.0
INLINE_RECHECK = 1.0


def run_steps(
    rt: Runtime, run_id: str, step_id: str, more: Callable[[int], bool] | None = None
) -> int:
    """Execute the step, then the run's next ones in this same task while each replay
    records exactly one (a sequential run). ``more(n)``, asked once the n-th step's
    body has run, says whether the task may run another; by default, up to
    ``inline_steps`` steps (within ``INLINE_SECONDS`` if others wait for a slot), until
    a shutdown begins. Returns how many attempts it ran."""
    more = more or _task_limits(rt)
    with log_context(run_id=run_id, step_id=step_id):
        att = take(rt, run_id, step_id)
    return _chain(att, more, 0)


def _chain(att: Attempt | None, more: Callable[[int], bool], ran: int) -> int:
    """Run ``att`` and the run's next ones kept inline. An async one goes on as a
    greenlet on a strand if its process has room there (``fleet/worker/strands.py``),
    and this slot is free at once; it then counts nothing more here."""
    while att is not None:
        if _leaves_its_slot(att) and process.current().strands.hand(
            partial(_off_its_slot, att, more, ran)
        ):
            return ran
        ran += 1
        att = _run_one(att, partial(more, ran))
    return ran


def _off_its_slot(att: Attempt | None, more: Callable[[int], bool], ran: int) -> None:
    """``_chain`` on a strand or the loop's thread (where nothing leaves its slot again).
    No Celery task is there to report a store failure: it ends the chain as it ends a
    task on a slot (the sweeper takes the step up again, once its lease expires if it
    held one), said in one line naming the step."""
    while att is not None:
        ran += 1
        this = att
        try:
            att = _run_one(this, partial(more, ran))
        except StoreUnavailable as exc:
            log.warning(
                "step %s of run %s: the store failed under it (%s); the sweeper takes it up again",
                this.step_id,
                this.run_id,
                exc,
            )
            return


def _leaves_its_slot(att: Attempt) -> bool:
    """An async attempt on a slot, in a process whose strands are on."""
    return is_async(att.sd.fn) and process.current().strands.on and strands.current() is None


def advance_steps(rt: Runtime, run_id: str, more: Callable[[int], bool] | None = None) -> int:
    """What the ``fleet.advance`` task does: replay the run (``replay.advance``), send
    what it recorded but its first task step, and execute that one here, then the
    run's next ones as ``run_steps`` does (``more`` as there). Returns how many
    attempts it ran."""
    with log_context(run_id=run_id):
        kept = _replay_keeping_first(rt, run_id)
    if kept is None:
        return 0
    replayed, first = kept
    replayed.send(rt)
    if first is None:
        return 0
    with log_context(run_id=run_id, step_id=first.step_id):
        att = _lease_of(rt, replayed.run, first)
    return _chain(att, more or _task_limits(rt), 0)


def _replay_keeping_first(rt: Runtime, run_id: str) -> tuple[Replayed, _Kept | None] | None:
    """Replay the run and take the lease of its first task step in one transaction:
    the run started or resumed, its next steps recorded, the run marked advanced and
    that step's lease taken commit together (one commit to wait for instead of four
    for a new run; the take goes out with the COMMIT). Returns what is left to send and
    the step kept; None: the run was not replayed. If that transaction fails, each
    store call is made on its own, as ``commit`` falls back.

    Postgres only: there the transaction locks nothing until the workflow has run (its
    first write, ``Ledger.begin_replay``, comes after), so a worker frozen in the
    workflow blocks no other advance of the run. SQLite takes its write lock at BEGIN:
    there each store call stays its own transaction, as a frozen replay must not hold
    the whole store."""
    if rt.settings.is_sqlite:
        return _replay_then_keep(rt, run_id)
    try:
        with rt.db.transaction() as tx:
            bound = rt.within(tx)
            replayed = replay_run(bound, run_id)
            kept = None if replayed is None else _keep_first(bound, replayed)
    except CommitUnknown:
        raise  # it may have applied: the sweeper sends the run's advance if it did not
    except Exception as exc:  # noqa: BLE001 - rolled back whole: nothing of it applied
        log.warning(
            "advance of run %s in one transaction failed (%s); store call by store call instead",
            run_id,
            exc,
        )
        return _replay_then_keep(rt, run_id)
    return kept


def _replay_then_keep(rt: Runtime, run_id: str) -> tuple[Replayed, _Kept | None] | None:
    """The fallback: the replay's store calls each their own transaction, then the
    first task step's lease taken in one of its own, with the run row the replay read."""
    replayed = replay_run(rt, run_id)
    return None if replayed is None else _keep_first(rt, replayed)


def _keep_first(rt: Runtime, replayed: Replayed) -> tuple[Replayed, _Kept | None]:
    """The replay's first task step taken to run here (its lease taken in ``rt``'s
    transaction, at its commit, if it is bound to one); the others left to send."""
    first = _first_to_run(rt, replayed)
    if first is None:
        return replayed, None
    lease = rt.ledger.take_lease_at_commit(
        replayed.run.id,
        first.step_id,
        rt.worker_name,
        rt.settings.lease_seconds,
        replayed.run.limited,
    )
    rest = [t for t in replayed.tasks if t is not first]
    return replace(replayed, tasks=rest), _Kept(first.step_id, lease)


def _first_to_run(rt: Runtime, replayed: Replayed) -> NewTask | None:
    """The task step an advance runs itself: the first one recorded, unless this
    worker does not have it, it names limits (sent: it takes room before its lease),
    the task may run none (``inline_steps`` 0) or a shutdown has begun."""
    if not replayed.tasks or rt.settings.inline_steps < 1:
        return None
    if process.current().stopping.is_set():
        return None
    first = replayed.tasks[0]
    sd = rt.registry.steps.get(first.name)
    if sd is None or sd.limits:
        return None
    return first


def _task_limits(rt: Runtime) -> Callable[[int], bool]:
    deadline = time.monotonic() + INLINE_SECONDS
    stopping = process.current().stopping
    cap = rt.settings.inline_steps
    # On a strand, each chain hands its run back after a number of steps drawn in the
    # upper half of the cap: runs started together (a batch of 500) would otherwise all
    # hand back at the same step, and their 500 messages queue behind each other
    # through the one consumer (bench.async_steps --steps 60: attempts 1.8 s for 1 s).
    on_strand = random.randint((cap + 1) // 2, cap) if cap > 1 else cap

    def more(n: int) -> bool:
        nonlocal deadline
        if stopping.is_set() or n >= (cap if strands.current() is None else on_strand):
            return False
        # On a strand the run holds no slot that others could wait for: handing it
        # back would only send one more message through the consumer (bench.async_steps
        # c=500 on a slow host: every run handed back each 5 s, 0.24 of the limit).
        if time.monotonic() < deadline or strands.current() is not None:
            return True
        if _others_wait(rt):
            return False
        deadline = time.monotonic() + INLINE_RECHECK
        return True

    return more


def _others_wait(rt: Runtime) -> bool:
    """Whether work waits for a slot of this worker: tasks it took and has not started
    (Celery's own count), or messages on its queues (unknown, if the broker does not
    answer, counts as waiting)."""
    if len(worker_state.reserved_requests) > len(worker_state.active_requests):
        return True
    return _QUEUED.ask(rt)


class _Queued:
    """Whether messages wait on a runtime's queues, asked of the broker at most once per
    ``INLINE_RECHECK`` / 2 for all of a process's slots (500 slots asking each second
    would be 500 broker round trips a second). Yes only if they did at two looks in a
    row: a message seen once may be one passing through (a run handed back a moment
    ago, about to be taken), and answering yes to it made every slot hand back in turn,
    each one's message the next one's reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(runtime) -> (when last asked, the answer, whether messages waited then)
        self._answers: dict[int, tuple[float, bool, bool]] = {}

    def ask(self, rt: Runtime) -> bool:
        now = time.monotonic()
        with self._lock:
            when, answer, seen = self._answers.get(id(rt), (-INLINE_RECHECK, False, False))
            if now - when < INLINE_RECHECK / 2:
                return answer
            # Claimed: the others take this answer until this slot has the new one.
            self._answers[id(rt)] = (now, answer, seen)
        waiting = rt.dispatcher.waiting(rt.registry.queues(rt.settings.queue))
        queued = waiting is None or waiting > 0
        answer = queued and seen and now - when <= _IN_A_ROW
        with self._lock:
            self._answers[id(rt)] = (time.monotonic(), answer, queued)
        return answer


# Two looks further apart than this (seconds) are not in a row: what the older one saw
# is long gone.
_IN_A_ROW = 5.0


_QUEUED = _Queued()


def _run_one(att: Attempt, keep_next: Callable[[], bool]) -> Attempt | None:
    """One attempt; the run's next one, if this task took its lease while committing."""
    with running(att):
        out = perform(att)
        if out is None:
            return None
        if not keep_next():
            commit(att, out)
            return None
        kept = commit(att, out, claim=partial(_keep_the_one_next, att))
        return _next_attempt(att, kept)


@dataclass(frozen=True)
class _Kept:
    """The one next step the replay recorded, not sent: its lease, held or refused
    (known once the commit's transaction has committed)."""

    step_id: str
    lease: Callable[[], Lease | TakeRefused]


def _keep_the_one_next(
    att: Attempt, bound: Runtime, replayed: Replayed
) -> tuple[Replayed, _Kept | None]:
    """Take the lease of the run's next step if the replay recorded exactly one (and
    then send nothing); otherwise send them all. ``bound``: the runtime bound to the
    commit's transaction, so the lease is taken in it (or, if that transaction failed,
    the plain runtime of the step committed alone)."""
    if len(replayed.tasks) != 1:
        return replayed, None
    (task,) = replayed.tasks
    if strands.current() is not None and not _async_step(bound, task.name):
        return replayed, None  # a strand runs no sync body: that step is sent, to a slot
    # On Postgres the take goes out with the COMMIT; its answer is read after it.
    lease = bound.ledger.take_lease_at_commit(
        att.run_id, task.step_id, bound.worker_name, bound.settings.lease_seconds, att.run.limited
    )
    return replace(replayed, tasks=[]), _Kept(task.step_id, lease)


def _async_step(rt: Runtime, name: str) -> bool:
    sd = rt.registry.steps.get(name)
    return sd is not None and is_async(sd.fn)


def _next_attempt(att: Attempt, kept: _Kept | None) -> Attempt | None:
    """After the commit: the kept step's attempt, or why its lease was refused, acted on."""
    return None if kept is None else _lease_of(att.rt, att.run, kept)


def _lease_of(rt: Runtime, run: RunRow, kept: _Kept) -> Attempt | None:
    """Once what took it has committed: the kept step's attempt, or why its lease was
    refused, acted on (``failures.refused``)."""
    lease = kept.lease()
    if isinstance(lease, TakeRefused):
        refused(rt, run, kept.step_id, lease)
        return None
    # The replay has just called the step, so this worker has it.
    return Attempt(rt, run, rt.registry.steps[lease.name], lease)
