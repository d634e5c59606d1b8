"""Live runs: a run's workflow kept suspended in the worker between its advances.

A replay runs the workflow function from the top over the run's recorded outputs, so
an advance costs time in proportion to the run's length. A live run's workflow runs on
a thread of its own instead (its *keeper*): where a replay would unwind (``Suspend``)
it parks (``WorkflowContext._park``), its thread waiting, and this process keeps it.
The run's next advance, on whichever thread, hands it that advance's history and
resumes it where it parked, whatever the run's length (Temporal's sticky workflow
cache does the same for its workers).

What the resumed workflow goes on to do is exactly what a replay from the top over the
same history would do:
- everything it was handed before the positions it parked on came from ``done`` rows,
  and a done row never changes (the argument of fleet/store/history.py); a context
  that was handed a dead step's error (``dirty``) is not kept, since a replayed dead
  letter turns that step back to pending;
- the rows of the positions it parked on are read again from the new history, which
  ``take`` first checks has those very steps there, and every position it reserved;
- it is the same run (id and creation time: retention may delete a finished run and
  the id be enqueued again), the same workflow of the same registry and store;
- it is kept only once the transaction its advance wrote in has committed
  (``after_commit``): a workflow that went on past writes that rolled back is dropped,
  never resumed.
Anything else (another process, an entry dropped for room, a check that fails) replays
from the top, which stays the recovery path every kill test exercises.

One thread owns each parked workflow, by construction: the workflow's code runs only
on its keeper, which starts it, parks it, resumes it and unwinds it. The thread that
advances the run hands the keeper its advance (the history through the context, its
context variables) and waits until the workflow parks, returns or raises: the
advance's store calls run there in the advance's transaction while the advancing
thread waits, so the two never touch the store at once, and a lock the workflow waits
for is never held behind it by another run's workflow (each has its own thread). A
dropped workflow is unwound on its keeper (``Dropped`` raised where it parked), which
then ends; a ``Live`` let go without a drop (an advance that failed after it parked)
is dropped when it is collected. What a process keeps belongs to that process
(``LiveRuns`` looks at its pid): a forked child starts with nothing kept, and never
touches what its parent's threads hold. Not on a gevent pool, where threads are
greenlets of one thread and a store call switches between them under the workflow:
there every advance replays. At most ``FLEET_LIVE_RUNS`` entries per process, holding
at most ``MAX_BYTES`` of recorded outputs between them (a parked workflow keeps every
output it was handed alive, as the workflow itself often does), the least recently
parked dropped first.
"""

from __future__ import annotations

import contextvars
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from queue import SimpleQueue
from typing import Any

from fleet.registry import Registry, WorkflowDef
from fleet.store.engine import Database, after_commit
from fleet.store.rows import RunRow, StepRow
from fleet.worker.runtime import Runtime, under_gevent
from fleet.worker.workflow import PARKED, WorkflowContext

# What the parked workflows of one process may hold between them, in recorded bytes of
# the outputs they were handed (the history cache's bound, fleet/store/history.py).
MAX_BYTES = 64 * 1024 * 1024


class Dropped(BaseException):
    """Raised where a dropped workflow parked, on its keeper: it unwinds, and the
    thread ends. A ``BaseException``, as ``GeneratorExit`` is: a workflow's ``except
    Exception`` does not swallow it."""


class Keeper:
    """The thread a live workflow runs on, and the queues an advance hands it through:
    to it, the advancing thread's context variables (None: unwind); from it, what the
    workflow did (parked, returned, raised). It holds no reference to its ``Live``,
    so a ``Live`` nobody keeps is collected, and drops it."""

    def __init__(self, name: str, body: Callable[[], Any]) -> None:
        self._name = name
        self._body = body
        self._inbox: SimpleQueue[contextvars.Context | None] = SimpleQueue()
        self._outbox: SimpleQueue[tuple[bool, Any]] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.parked = False  # its workflow parked at the end of the latest ``go``
        self.dropped = False

    def go(self, context: contextvars.Context) -> Any:
        """Start or resume the workflow, in ``context``'s variables, and wait until it
        parks (``PARKED``), returns (its value) or raises (raised here)."""
        if self.dropped:
            raise RuntimeError(f"{self._name}: a dropped workflow is never resumed")
        self.parked = False
        if self._thread is None:
            self._thread = threading.Thread(
                target=context.run, args=(self._serve,), name=self._name, daemon=True
            )
            self._thread.start()
        else:
            self._inbox.put(context)
        try:
            returned, value = self._outbox.get()
        except BaseException:  # this thread interrupted (a signal's exception): let it go
            self.drop()
            raise
        if not returned:
            raise value
        self.parked = value is PARKED
        return value

    def park(self) -> None:
        """On the keeper, where its workflow stops: hand ``PARKED`` back and wait for the
        next advance (its context variables set here) or the drop (``Dropped``)."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError(f"{self._name}: parked from a thread that is not its own")
        if not self.dropped:
            self._outbox.put((True, PARKED))
            context = self._inbox.get()
            if context is not None:
                for var, value in context.items():
                    var.set(value)
                return
        raise Dropped

    def drop(self) -> None:
        """Never resume it: its keeper unwinds it (now if it is parked, else where it
        next parks) and ends. From any thread of the process that started it; in a
        forked child, nothing (the keeper is not there)."""
        if self.dropped or os.getpid() != self._pid:
            return
        self.dropped = True
        self._inbox.put(None)

    def _serve(self) -> None:
        try:
            outcome = (True, self._body())
        except Dropped:
            return
        except BaseException as exc:  # the workflow's own error: raised by ``go``
            outcome = (False, exc)
        self._outbox.put(outcome)


@dataclass(eq=False)
class Live:
    """One run's workflow, started or parked on its keeper."""

    ctx: WorkflowContext
    wf: WorkflowDef
    args: list[Any]
    kwargs: dict[str, Any]
    registry: Registry  # the runtime's it was started with: a resume's must be the same
    db: Database
    created_at: float
    # The secret values its workflow revealed in earlier advances: each advance's
    # redactor masks them too, as a replay that revealed them again would.
    revealed: frozenset[str] = frozenset()
    keeper: Keeper = field(init=False)

    def __post_init__(self) -> None:
        body = partial(self.wf.fn, self.ctx, *self.args, **self.kwargs)
        self.keeper = Keeper(f"fleet-live {self.ctx.run_id}"[:80], body)
        # Collected without a drop (an advance failed after it parked): dropped then.
        weakref.finalize(self, self.keeper.drop).atexit = False

    def run(self) -> Any:
        """Start or resume the workflow on its keeper until it parks (``PARKED``),
        returns (its result) or raises (its exception, raised here)."""
        self.ctx.live = self.keeper.park
        return self.keeper.go(contextvars.copy_context())

    @property
    def parked(self) -> bool:
        return self.keeper.parked and not self.keeper.dropped and self.ctx.parked is not None

    def fits(self, rt: Runtime, run: RunRow, history: Sequence[StepRow]) -> bool:
        """It may be resumed for this advance of ``run`` over ``history``."""
        ctx = self.ctx
        if ctx.parked is None or ctx.dirty:
            return False
        if self.created_at != run.created_at:
            return False
        if self.registry is not rt.registry or self.db is not rt.db:
            return False
        if len(history) < ctx.reached:  # a position it reserved is not in the history
            return False
        start, ids = ctx.parked
        return all(history[start + i].step_id == step_id for i, step_id in enumerate(ids))

    def drop(self) -> None:
        """Never resume it; its keeper unwinds it and ends."""
        self.ctx.live = None
        self.keeper.drop()


@dataclass
class _Kept:
    """What one process keeps: a forked child's is its own, made at its first use."""

    pid: int = field(default_factory=os.getpid)
    lock: threading.Lock = field(default_factory=threading.Lock)
    entries: OrderedDict[str, tuple[Live, int]] = field(default_factory=OrderedDict)
    bytes: int = 0


class LiveRuns:
    """This process's parked workflows, one per run: the one its latest advance parked.
    Any thread may take one to resume it (its keeper runs it)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._kept = _Kept()
        self.resumed = 0  # advances that resumed a parked workflow, for the benchmarks

    @property
    def _here(self) -> _Kept:
        kept = self._kept
        if kept.pid != os.getpid():  # a forked child: what its parent kept is not its
            kept = self._kept = _Kept()  # own, nor is a lock a thread of the parent held
        return kept

    def take(
        self, rt: Runtime, run: RunRow, history: Sequence[StepRow], wf: WorkflowDef
    ) -> Live | None:
        """The run's parked workflow, taken out, if it may be resumed for this advance;
        None: replay from the top (and the entry, if any, is dropped)."""
        live = self._pop(run.id)
        if live is None:
            return None
        if live.wf is not wf or not live.fits(rt, run, history):
            live.drop()
            return None
        self.resumed += 1
        return live

    def holds(self, run_id: str) -> bool:
        """This process keeps a parked workflow of the run."""
        return run_id in self._here.entries

    def _pop(self, run_id: str) -> Live | None:
        kept = self._here
        with kept.lock:
            entry = kept.entries.pop(run_id, None)
            if entry is None:
                return None
            kept.bytes -= entry[1]
            return entry[0]

    def discard(self, run_id: str) -> None:
        """Drop the parked workflow of a run that will not be advanced again."""
        live = self._pop(run_id)
        if live is not None:
            live.drop()

    def keep(self, live: Live, limit: int) -> None:
        """Keep a parked workflow for the run's next advance (in place of any other of
        the run), dropping the least recently parked past ``limit`` entries or
        ``max_bytes`` (one that alone holds more is not kept: replaying it is cheaper
        than holding it)."""
        size = live.ctx.talk.held_bytes
        dropped: list[Live] = []
        kept = self._here
        with kept.lock:
            old = kept.entries.pop(live.ctx.run_id, None)
            if old is not None:
                kept.bytes -= old[1]
                if old[0] is not live:
                    dropped.append(old[0])
            kept.entries[live.ctx.run_id] = (live, size)
            kept.bytes += size
            while kept.entries and (len(kept.entries) > limit or kept.bytes > self.max_bytes):
                gone, gone_size = kept.entries.popitem(last=False)[1]
                kept.bytes -= gone_size
                dropped.append(gone)
        for entry in dropped:
            entry.drop()

    def clear(self) -> None:
        kept = self._here
        with kept.lock:
            entries = [live for live, _ in kept.entries.values()]
            kept.entries.clear()
            kept.bytes = 0
        for entry in entries:
            entry.drop()

    @property
    def held_bytes(self) -> int:
        return self._here.bytes

    def __len__(self) -> int:
        return len(self._here.entries)


RUNS = LiveRuns()


def start(
    rt: Runtime,
    wf: WorkflowDef,
    ctx: WorkflowContext,
    args: list[Any],
    kwargs: dict[str, Any],
) -> Live | None:
    """A workflow to run live, if this process keeps live runs (None: replay it)."""
    if rt.settings.live_runs <= 0 or under_gevent():
        return None
    return Live(ctx, wf, args, kwargs, rt.registry, rt.db, ctx.created_at)


def keep_once_committed(rt: Runtime, live: Live) -> None:
    """Keep ``live`` once what its advance wrote has committed: at once if each write
    was its own transaction, else when ``rt``'s transaction commits (never if it rolls
    back: then nothing keeps it, and it is dropped when collected)."""
    if not live.parked or live.ctx.dirty:
        live.drop()
        return
    limit = rt.settings.live_runs
    tx = rt.ledger.tx
    if tx is None:
        RUNS.keep(live, limit)
    else:
        after_commit(tx.conn, lambda: RUNS.keep(live, limit))
