"""Where a step that did not finish goes: retried, dead-lettered, or dropped (invariant 6).

A failed attempt is retried by its step's policy (exponential backoff with full
jitter, a durable attempt cap; a non-retryable error skips the retries): soon ones as
a countdown message, later ones kept in the store for the sweeper. When the cap trips
the step is dead-lettered with its input, error and traceback, the ``on_dead_letter``
hooks are told, and the run is replayed at once (unless the step is a branch of a
fan-out whose siblings have not all settled: the last of them replays it). A delivery
whose lease was refused is routed here too, by why it was refused.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

from fleet.errors import FleetError
from fleet.policy import Verdict, classify
from fleet.records import DeadLetterInfo
from fleet.secrets import Redactor
from fleet.states import Incident, StepStatus
from fleet.store.ledger import TakeRefused
from fleet.store.queries import Snapshot
from fleet.store.rows import RunRow
from fleet.store.step_ledger import LetterId
from fleet.worker import strands
from fleet.worker.context import Attempt, LeaseLost
from fleet.worker.replay import Replayed, replay_run, step_shadow
from fleet.worker.runtime import Runtime

log = logging.getLogger("fleet.attempt")

# Retries due sooner than this go back to the broker as a countdown message; later
# ones wait in the store for the sweeper (a countdown longer than the broker's
# visibility timeout would be redelivered while still waiting).
COUNTDOWN_LIMIT = 60.0


def countdown_limit(rt: Runtime) -> float:
    """The longest retry delay sent as a countdown message rather than kept in the store."""
    return min(COUNTDOWN_LIMIT, rt.settings.visibility_timeout / 2)


@dataclass(frozen=True)
class Failure:
    """Why a step is dead-lettered, as its dead letter records it. ``epoch``: the
    attempt's, fencing the write; None when no attempt holds the step (its attempts
    were all lost with their workers). ``why`` is for the log only."""

    error_type: str
    message: str
    traceback: str | None
    why: str
    epoch: int | None = None


def failed(att: Attempt, exc: Exception, redact: Redactor) -> None:
    """Retry the step or dead-letter it. Every text recorded or logged is ``redact``-ed:
    a step may quote a secret it used in its exception."""
    rt, run, sd, lease = att.rt, att.run, att.sd, att.lease
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
        countdown = delay <= countdown_limit(rt)
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
    tb = redact("".join(traceback.format_exception(exc)))
    failure = Failure(type(exc).__name__, message, tb, verdict, epoch=lease.epoch)
    dead_letter(rt, run, lease.step_id, failure)


def _message(exc: BaseException) -> str:
    """``str(exc)``, even for an exception whose ``__str__`` itself raises."""
    try:
        return str(exc)
    except Exception:
        return f"<the {type(exc).__name__}'s message could not be read>"


def refused(rt: Runtime, run: RunRow, step_id: str, why: TakeRefused) -> None:
    """Act on a lease this worker was refused: each zero-rows case of ``take_lease``."""
    if why is TakeRefused.EXHAUSTED:
        step = rt.queries.step(run.id, step_id)
        attempts = step.attempts if step else 0
        failure = Failure(
            "AttemptsExhausted",
            f"all {attempts} attempt(s) were lost with their worker",
            None,
            "every attempt crashed its worker",
        )
        dead_letter(rt, run, step_id, failure)
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
        rt.ledger.incident(
            Incident.DUPLICATE_DELIVERY, run.id, step_id, worker=rt.worker_name, detail=why
        )
    log.info("execute %s of run %s dropped: %s", step_id, run.id, why)


def _resend_when_due(rt: Runtime, run: RunRow, step_id: str) -> None:
    """A retry's countdown message came before its due time on the store's clock (the
    worker's clock runs ahead): send it again for the remaining time rather than leave
    it to the sweeper's grace period. A retry due by the time this looks (the refusal
    and this read straddled the due time) is sent again at once, not dropped; a step
    refused for another reason (in doubt, say) is not: it would come back refused."""
    step = rt.queries.step(run.id, step_id)
    if step is None or step.due_at is None:
        return
    remaining = step.due_at - rt.queries.now()
    if remaining <= 0 and step.status is not StepStatus.RETRY_WAIT:
        return
    if remaining <= countdown_limit(rt):
        rt.dispatcher.execute(
            run.id,
            step_id,
            run.queue,
            countdown=max(remaining, 0.0) + 0.01,
            shadow=step_shadow(run.workflow, step.name),
        )


def dead_letter(rt: Runtime, run: RunRow, step_id: str, failure: Failure) -> None:
    """Dead-letter the step; if this writer did it, tell the hooks and move the run on."""
    letter_id = rt.ledger.dead_letter(
        run.id,
        step_id,
        epoch=failure.epoch,
        workflow=run.workflow,
        error_type=failure.error_type,
        error_message=failure.message,
        traceback=failure.traceback,
    )
    if letter_id is None:
        return  # fenced, or another writer settled the step first
    log.error(
        "step %s of run %s dead-lettered (%s): %s: %s",
        step_id,
        run.id,
        failure.why,
        failure.error_type,
        failure.message,
    )
    if rt.dead_letter_hooks:
        # The hooks are the application's sync code: off the event loop's thread.
        strands.off_the_loop(_tell_hooks, rt, letter_id)
    if not letter_id.replay:
        return  # a branch whose siblings have not all settled: the last one replays
    replayed = replay_here(rt, run.id)
    if replayed is not None:
        replayed.send(rt)


def _tell_hooks(rt: Runtime, letter_id: LetterId) -> None:
    row = rt.queries.dead_letter(letter_id)
    info = DeadLetterInfo.from_row(row, rt.payloads.load)
    for hook in rt.dead_letter_hooks:
        try:
            hook(info)
        except Exception:
            log.exception("on_dead_letter hook %r failed for dead letter %d", hook, letter_id)


def replay_here(rt: Runtime, run_id: str, snapshot: Snapshot | None = None) -> Replayed | None:
    """Replay the run right here, after this worker's own write to it, rather than
    through another broker message: the worker already holds the workflow. The
    wake-up was recorded with the write, so if this fails (None) or the process dies
    the sweeper sends the advance instead."""
    try:
        return replay_run(rt, run_id, snapshot)
    except FleetError as exc:
        log.warning(
            "advance of run %s after a step failed (%s); the sweeper will retry", run_id, exc
        )
        return None
