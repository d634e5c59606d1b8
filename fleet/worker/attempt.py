"""One attempt of one step: take the lease, heartbeat, run, commit under the epoch held.

Every decision here is made by a conditional write in the ledger; this module only
sequences them and talks to the user's step function.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from fleet.errors import FleetError
from fleet.logs import log_context
from fleet.policy import Verdict, classify
from fleet.records import DeadLetterInfo
from fleet.registry import StepDef
from fleet.secrets import Redactor, redacting
from fleet.states import Incident, IntentOutcome
from fleet.store.engine import CommitUnknown
from fleet.store.ledger import Committed, Lease, TakeRefused
from fleet.store.queries import Snapshot
from fleet.worker.replay import advance, pinned_workflow, step_shadow
from fleet.worker.runtime import Runtime

log = logging.getLogger("fleet.attempt")

# Retries due sooner than this go back to the broker as a countdown message; later
# ones wait in the store for the sweeper (a countdown longer than the broker's
# visibility timeout would be redelivered while still waiting).
COUNTDOWN_LIMIT = 60.0


def _countdown_limit(rt: Runtime) -> float:
    """The longest retry delay sent as a countdown message rather than kept in the store."""
    return min(COUNTDOWN_LIMIT, rt.settings.visibility_timeout / 2)


class LeaseLost(FleetError):
    """This attempt's lease was taken over or revoked; its result will not be recorded."""


class StepContext:
    """The first argument of a step function (see CONTRACT.md)."""

    def __init__(self, rt: Runtime, lease: Lease, heartbeat: Heartbeat) -> None:
        self.run_id = lease.run_id
        self.step_id = lease.step_id
        self.attempt = lease.attempt
        self.epoch = lease.epoch
        self.idempotency_key = f"{lease.run_id}:{lease.step_id}"
        self._rt = rt
        self._heartbeat = heartbeat

    @property
    def lease_lost(self) -> bool:
        return self._heartbeat.lost.is_set()

    def heartbeat(self) -> None:
        """Renew the lease now. Raises ``LeaseLost`` if another attempt has taken over:
        a long step calling this stops early instead of working for nothing."""
        if not self._heartbeat.beat():
            raise LeaseLost(
                f"step {self.step_id} of run {self.run_id} lost its lease (epoch {self.epoch})"
            )

    def record_usage(
        self,
        model: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cost: float = 0.0,
    ) -> None:
        """Add what this attempt spent; written at once, so a crash later keeps it."""
        self._rt.ledger.add_usage(
            self.run_id,
            self.step_id,
            self.epoch,
            model=model,
            input_tokens=int(input_tokens),
            output_tokens=int(output_tokens),
            cost=float(cost),
        )


class Heartbeat:
    """Keeps one attempt's lease: the process's beater thread renews it every third of
    the lease while the attempt runs (one thread for all of them, not one per attempt)."""

    def __init__(self, rt: Runtime, lease: Lease) -> None:
        self._rt = rt
        self._lease = lease
        self.lost = threading.Event()
        self.interval = rt.settings.lease_seconds / 3
        self.due = 0.0  # monotonic time of the next renewal
        # Held while renewing: leaving the attempt waits for a renewal in flight, so
        # none is written after the attempt's own commit.
        self._lock = threading.Lock()
        self._held = False

    def beat(self) -> bool:
        if self.lost.is_set():
            return False
        try:
            ok = self._rt.ledger.heartbeat(
                self._lease.run_id,
                self._lease.step_id,
                self._lease.epoch,
                self._rt.settings.lease_seconds,
            )
        except FleetError as exc:  # store briefly unreachable: try again next beat
            log.warning("heartbeat for %s failed: %s", self._lease.step_id, exc)
            return True
        if not ok:
            self.lost.set()
            log.warning(
                "step %s of run %s lost its lease (epoch %d)",
                self._lease.step_id,
                self._lease.run_id,
                self._lease.epoch,
            )
        return ok

    def renew_if_held(self) -> None:
        """The beater's renewal: skipped once the attempt has left."""
        with self._lock:
            if self._held and not self.beat():
                _BEATER.remove(self)

    def __enter__(self) -> Heartbeat:
        self._held = True
        _BEATER.add(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _BEATER.remove(self)
        with self._lock:
            self._held = False

    def release(self) -> bool:
        """Give the lease up now (shutdown): stop renewing it and let it expire in the
        store, so another worker takes the step at once instead of after the lease."""
        self.lost.set()
        _BEATER.remove(self)
        with self._lock:  # a renewal in flight lands before the release, not after
            pass
        return self._rt.ledger.release_lease(
            self._lease.run_id, self._lease.step_id, self._lease.epoch
        )


class _Beater:
    """One thread per process renews every lease its attempts hold, each when due;
    it is started on first use, and again in a forked child (threads do not survive
    fork). The attempts it holds are also what ``release_leases`` gives up."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[int, Heartbeat] = {}
        self._pid = 0

    def add(self, hb: Heartbeat) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child: a thread of its own
                self._pid = os.getpid()
                self._held.clear()
                threading.Thread(target=self._loop, name="fleet-heartbeat", daemon=True).start()
            hb.due = time.monotonic() + hb.interval
            self._held[id(hb)] = hb
            self._cond.notify()

    def remove(self, hb: Heartbeat) -> None:
        with self._cond:
            self._held.pop(id(hb), None)

    def held(self) -> list[Heartbeat]:
        with self._cond:
            return list(self._held.values())

    def _due(self) -> list[Heartbeat]:
        """Wait until some lease is due for renewal; those that are, rescheduled."""
        with self._cond:
            while True:
                now = time.monotonic()
                due = [hb for hb in self._held.values() if hb.due <= now]
                if due:
                    for hb in due:
                        hb.due = now + hb.interval
                    return due
                soonest = min((hb.due for hb in self._held.values()), default=now + 60.0)
                self._cond.wait(soonest - now)

    def _loop(self) -> None:
        while True:
            for hb in self._due():
                try:
                    hb.renew_if_held()
                except Exception:  # never let one renewal stop the others
                    log.exception("renewing the lease of %s failed", hb._lease.step_id)


_BEATER = _Beater()


def release_leases(rt: Runtime) -> int:
    """Release the leases of this process's running attempts (of ``rt``) and send their
    steps straight back to the queue. Their own commits, if they still come, are
    accepted only if nobody took over meanwhile (the epoch decides)."""
    mine = [hb for hb in _BEATER.held() if hb._rt is rt]
    released = 0
    for hb in mine:
        lease = hb._lease
        if hb.release():
            released += 1
            run = rt.queries.run(lease.run_id)
            if run is not None:
                rt.dispatcher.execute(
                    lease.run_id,
                    lease.step_id,
                    run.queue,
                    shadow=step_shadow(run.workflow, lease.name),
                )
            log.warning(
                "released the lease of step %s of run %s (epoch %d) at shutdown",
                lease.step_id,
                lease.run_id,
                lease.epoch,
            )
    return released


# Set when this process begins a warm shutdown: tasks stop running further steps inline.
stopping = threading.Event()

# However many steps ``inline_steps`` allows, a task hands the run back to the queue
# after this long, so one long run does not keep a worker slot from the others.
INLINE_SECONDS = 5.0


def run_steps(rt: Runtime, run_id: str, step_id: str) -> None:
    """Execute the step, then the run's next ones in this same task while each replay
    records exactly one (a sequential run): no broker round trip, no second read. Up
    to ``inline_steps`` steps or ``INLINE_SECONDS``; then the next step is sent as a
    message like any other. A step kept for inline execution is in the store already:
    if this process dies before taking it (or while running it), the sweeper sends it."""
    deadline = time.monotonic() + INLINE_SECONDS
    ran = 0

    def more() -> bool:
        return (
            ran + 1 < rt.settings.inline_steps
            and time.monotonic() < deadline
            and not stopping.is_set()
        )

    following: str | Taken | None = step_id
    while following is not None:
        following = execute(rt, run_id, following, keep_next=more)
        ran += 1


@dataclass(frozen=True)
class Taken:
    """A step whose lease this task holds already: the next step of a sequential run,
    taken in the transaction that committed the step before it."""

    run: Any
    sd: StepDef
    lease: Lease


def execute(
    rt: Runtime,
    run_id: str,
    step: str | Taken,
    keep_next: Callable[[], bool] | None = None,
) -> str | Taken | None:
    """Run one attempt of a step if this delivery may; otherwise say why it drops.
    With ``keep_next`` (asked before the step commits), the run's next step, if it is
    the only one, is not sent but returned (taken, or by id): the caller executes it."""
    step_id = step if isinstance(step, str) else step.lease.step_id
    with log_context(run_id=run_id, step_id=step_id):
        taken = _take(rt, run_id, step_id) if isinstance(step, str) else step
        if taken is None:
            return None
        run, sd, lease = taken.run, taken.sd, taken.lease
        with log_context(epoch=lease.epoch, attempt=lease.attempt):
            log.info(
                "step %s of run %s: attempt %d, epoch %d on %s",
                step_id,
                run_id,
                lease.attempt,
                lease.epoch,
                rt.worker_name,
            )
            return _attempt(rt, run, sd, lease, keep_next)


def _take(rt: Runtime, run_id: str, step_id: str) -> Taken | None:
    run, step = rt.queries.run_and_step(run_id, step_id)
    if run is None or step is None:
        rt.ledger.incident(
            Incident.MALFORMED_MESSAGE, run_id, step_id, detail="execute for an unknown run or step"
        )
        log.warning("execute for unknown step %s of run %s dropped", step_id, run_id)
        return None
    if pinned_workflow(rt, run, step_id) is None:
        return None
    sd = rt.registry.steps.get(step.name)
    if sd is None:
        rt.ledger.incident(
            Incident.UNKNOWN_STEP,
            run_id,
            step_id,
            worker=rt.worker_name,
            detail=f"this worker has no step named {step.name!r}",
        )
        log.error("run %s needs step %r, which this worker does not have", run_id, step.name)
        return None
    owner = rt.worker_name
    lease = rt.ledger.take_lease(run_id, step_id, owner, rt.settings.lease_seconds)
    if isinstance(lease, TakeRefused):
        _refused(rt, run, step_id, lease, owner)
        return None
    return Taken(run, sd, lease)


def _attempt(
    rt: Runtime, run: Any, sd: StepDef, lease: Lease, keep_next: Callable[[], bool] | None
) -> str | Taken | None:
    run_id, step_id = lease.run_id, lease.step_id
    earlier: IntentOutcome | None = None
    # Redacting: the secrets this attempt uses never show in what it records or logs.
    with Heartbeat(rt, lease) as hb, redacting() as redact:
        ctx = StepContext(rt, lease, hb)
        what = f"output of step {step_id}"
        failure: Exception | None = None
        try:
            # Loaded first: an input that cannot be (PayloadError) is dead-lettered at
            # once, before an effect writes its intent.
            args, kwargs = rt.payloads.load_call(lease.input, f"input of step {step_id}")
            redact.watch((args, kwargs))
            gate = _effect_gate(rt, sd, lease, ctx) if sd.effect else _Gate.RUN
            if gate is _Gate.STOP:
                return None
            if isinstance(gate, _Reconciled):
                encoded, earlier = rt.payloads.dump(gate.output, what), gate.settles
            else:
                output = sd.fn(ctx, *args, **kwargs)
                encoded = rt.payloads.dump(output, what)
        except Exception as exc:
            failure = exc
        if failure is not None:
            # Outside the except clause: an error recording the failure must not carry
            # the step's exception (and any secret it quotes) into Celery's log.
            _failed(rt, run, sd, lease, failure, redact)
            return None
    keep = keep_next is not None and keep_next()
    try:
        unit = _commit_and_continue(rt, run, sd, lease, encoded, earlier, keep)
    except CommitUnknown:
        raise  # it may have applied: the store decides when the lease expires
    except Exception as exc:
        # Rolled back whole, so nothing of it applied: commit the step on its own, as
        # one transaction, and replay the run after it.
        log.warning(
            "step %s of run %s: commit with the replay failed (%s); committing it alone",
            step_id,
            run_id,
            exc,
        )
        done = _commit(rt, sd, lease, encoded, earlier)
        if not done:
            _log_fenced(lease)
            return None
        return _advance_now(rt, run, done.snapshot, keep=keep)
    # Committed: from here on nothing may fall back to committing again.
    if not unit.applied:
        _log_fenced(lease)
        return None
    if isinstance(unit.kept, TakeRefused):
        assert unit.following is not None
        _refused(rt, run, unit.following, unit.kept, rt.worker_name)
        return None
    if unit.kept is None:
        return None
    assert unit.next_sd is not None
    return Taken(run, unit.next_sd, unit.kept)


@dataclass
class _Continued:
    """What one commit-and-continue transaction did."""

    applied: bool = False  # false: fenced
    following: str | None = None  # the one next step the replay recorded and kept
    kept: Lease | TakeRefused | None = None  # taking its lease: held, or why not
    next_sd: StepDef | None = None


def _commit_and_continue(
    rt: Runtime,
    run: Any,
    sd: StepDef,
    lease: Lease,
    encoded: str,
    earlier: IntentOutcome | None,
    keep: bool,
) -> _Continued:
    """One transaction: commit the step's output under the epoch held, replay the run
    (recording its next steps), and, with ``keep``, take the lease of the next step if
    the replay recorded exactly one. Messages for other new steps go after the commit."""
    unit = _Continued()
    with rt.db.unit():
        done = _commit(rt, sd, lease, encoded, earlier)
        if not done:
            return unit  # fenced: the attempt's outcome and the incident still commit
        unit.applied = True
        unit.following = advance(rt, run.id, done.snapshot, keep=keep)
        if unit.following is not None:
            unit.kept = rt.ledger.take_lease(
                run.id, unit.following, rt.worker_name, rt.settings.lease_seconds
            )
            if isinstance(unit.kept, Lease):
                # The replay has just called it, so this worker has it.
                unit.next_sd = rt.registry.steps[unit.kept.name]
    return unit


def _commit(
    rt: Runtime, sd: StepDef, lease: Lease, encoded: str, earlier: IntentOutcome | None
) -> Committed:
    """The step's output, under the epoch held, with the run and history for the replay."""
    return rt.ledger.commit_output(
        lease.run_id,
        lease.step_id,
        lease.epoch,
        encoded,
        earlier_intents=earlier,
        effect=sd.effect,
        snapshot=True,
    )


def _log_fenced(lease: Lease) -> None:
    log.warning(
        "fenced: step %s of run %s finished under epoch %d after losing its lease; "
        "its output was discarded",
        lease.step_id,
        lease.run_id,
        lease.epoch,
    )


class _Gate(Enum):
    RUN = "run the body"
    STOP = "do not run the body"


@dataclass(frozen=True)
class _Reconciled:
    output: Any
    settles: IntentOutcome = IntentOutcome.RECONCILED


def _effect_gate(rt: Runtime, sd: StepDef, lease: Lease, ctx: StepContext) -> _Gate | _Reconciled:
    """Before an effect's body runs: settle what earlier attempts may have done, then
    write this attempt's intent. Never retries an effect on a guess."""
    run_id, step_id = lease.run_id, lease.step_id
    if rt.queries.in_doubt(run_id, step_id, before_epoch=lease.epoch):
        if sd.reconcile_fn is not None:
            found = sd.reconcile_fn(ctx)
            if found is not None:
                log.info("effect %s of run %s: reconcile found it happened", step_id, run_id)
                return _Reconciled(found)
            log.info("effect %s of run %s: reconcile found it did not happen", step_id, run_id)
        elif not sd.idempotent:
            if rt.ledger.park_in_doubt(run_id, step_id, lease.epoch):
                log.warning(
                    "effect %s of run %s may have acted in an earlier attempt; the run needs "
                    "a decision: fleet resolve %s %s (--output JSON | --retry)",
                    step_id,
                    run_id,
                    run_id,
                    step_id,
                )
            return _Gate.STOP
        if not rt.ledger.supersede_intents(run_id, step_id, lease.epoch):
            return _Gate.STOP
    input_hash = hashlib.sha256(lease.input.encode()).hexdigest()
    if not rt.ledger.write_intent(run_id, step_id, lease.epoch, ctx.idempotency_key, input_hash):
        log.warning("effect %s of run %s lost its lease before acting", step_id, run_id)
        return _Gate.STOP
    return _Gate.RUN


def _refused(rt: Runtime, run: Any, step_id: str, why: TakeRefused, owner: str) -> None:
    if why is TakeRefused.EXHAUSTED:
        step = rt.queries.step(run.id, step_id)
        attempts = step.attempts if step else 0
        _dead_letter(
            rt,
            run,
            step_id,
            None,
            "AttemptsExhausted",
            f"all {attempts} attempt(s) were lost with their worker",
            None,
            "every attempt crashed its worker",
        )
        return
    if why is TakeRefused.OVER_BUDGET:
        if rt.ledger.park_over_budget(run.id):
            log.warning(
                "run %s reached its budget before step %s: it needs a decision "
                "(fleet resolve %s --raise-budget tokens=N | cost=X, or fleet cancel)",
                run.id,
                step_id,
                run.id,
            )
        return
    if why is TakeRefused.NOT_DUE:
        _resend_when_due(rt, run, step_id)
        return
    if why in (TakeRefused.LEASE_LIVE, TakeRefused.ALREADY_FINISHED):
        rt.ledger.incident(Incident.DUPLICATE_DELIVERY, run.id, step_id, worker=owner, detail=why)
    log.info("execute %s of run %s dropped: %s", step_id, run.id, why)


def _resend_when_due(rt: Runtime, run: Any, step_id: str) -> None:
    """A retry's countdown message came before its due time on the store's clock (the
    worker's clock runs ahead): send it again for the remaining time rather than leave
    it to the sweeper's grace period."""
    step = rt.queries.step(run.id, step_id)
    if step is None or step.due_at is None:
        return
    remaining = step.due_at - rt.queries.now()
    if 0 < remaining <= _countdown_limit(rt):
        rt.dispatcher.execute(
            run.id,
            step_id,
            run.queue,
            countdown=remaining + 0.01,
            shadow=step_shadow(run.workflow, step.name),
        )


def _failed(
    rt: Runtime, run: Any, sd: StepDef, lease: Lease, exc: Exception, redact: Redactor
) -> None:
    """Retry the step or dead-letter it. Every text recorded or logged is ``redact``-ed:
    a step may quote a secret it used in its exception."""
    message = redact(_message(exc))
    error = f"{type(exc).__name__}: {message}"
    if isinstance(exc, LeaseLost):
        verdict, delay = Verdict.RETRY, 0.0  # the write below is fenced anyway
    else:
        verdict, delay = classify(
            exc,
            attempt=lease.attempt,
            policy=sd.retry,
            non_retryable=sd.non_retryable,
            max_attempts=sd.retry.max_attempts,
        )
    if verdict is Verdict.RETRY:
        countdown = delay <= _countdown_limit(rt)
        if rt.ledger.schedule_retry(
            run.id, lease.step_id, lease.epoch, delay, error, countdown=countdown
        ):
            log.info(
                "step %s of run %s failed (%s); retry in %.2fs", lease.step_id, run.id, error, delay
            )
            if countdown:
                rt.dispatcher.execute(
                    run.id,
                    lease.step_id,
                    run.queue,
                    countdown=delay,
                    shadow=step_shadow(run.workflow, lease.name),
                )
        return
    _dead_letter(
        rt,
        run,
        lease.step_id,
        lease.epoch,
        type(exc).__name__,
        message,
        redact("".join(traceback.format_exception(exc))),
        verdict,
    )


def _message(exc: BaseException) -> str:
    """``str(exc)``, even for an exception whose ``__str__`` itself raises."""
    try:
        return str(exc)
    except Exception:
        return f"<the {type(exc).__name__}'s message could not be read>"


def _dead_letter(
    rt: Runtime,
    run: Any,
    step_id: str,
    epoch: int | None,
    error_type: str,
    message: str,
    tb: str | None,
    why: str,
) -> None:
    """Dead-letter the step; if this writer did it, tell the hooks and move the run on."""
    letter_id = rt.ledger.dead_letter(
        run.id,
        step_id,
        epoch=epoch,
        workflow=run.workflow,
        error_type=error_type,
        error_message=message,
        traceback=tb,
    )
    if letter_id is None:
        return  # fenced, or another writer settled the step first
    log.error(
        "step %s of run %s dead-lettered (%s): %s: %s", step_id, run.id, why, error_type, message
    )
    if rt.dead_letter_hooks:
        row = rt.queries.dead_letter(letter_id)
        info = DeadLetterInfo.from_row(row, rt.payloads.load)
        for hook in rt.dead_letter_hooks:
            try:
                hook(info)
            except Exception:
                log.exception("on_dead_letter hook %r failed for dead letter %d", hook, letter_id)
    _advance_now(rt, run)


def _advance_now(
    rt: Runtime, run: Any, snapshot: Snapshot | None = None, keep: bool = False
) -> str | None:
    """Replay the run right here rather than through another broker message: the
    worker already holds the workflow. The wake-up was recorded with the commit, so
    if this fails or the process dies the sweeper sends the advance instead."""
    try:
        return advance(rt, run.id, snapshot, keep=keep)
    except FleetError as exc:
        log.warning(
            "advance of run %s after a step failed (%s); the sweeper will retry", run.id, exc
        )
        return None
