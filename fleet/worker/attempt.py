"""One attempt of one step: take the lease, run the body under a heartbeat, commit the
output under the epoch held, and replay the run (a branch of a fan-out: only the last
of its branches to settle replays it).

Every decision here is made by a conditional write in the ledger; this module only
sequences them and talks to the user's step function. The commit and the replay after
it are one transaction, opened in ``commit`` and handed to both through a runtime
bound to it (``Runtime.within``); the steps the replay recorded are sent only once it
has committed. A caller may add to that transaction (``commit``'s ``claim``, handed
the same bound runtime): the sequential shortcut (``fleet/worker/inline.py``) takes
the next step's lease there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from fleet import codec, transcripts
from fleet.logs import log_context
from fleet.registry import StepDef
from fleet.secrets import redacting
from fleet.states import Incident, IntentOutcome
from fleet.store.engine import CommitUnknown
from fleet.store.ledger import Committed, Lease, TakeRefused
from fleet.store.rows import RunRow
from fleet.worker import gate as limits_gate
from fleet.worker import process, strands
from fleet.worker.aio import Runner
from fleet.worker.context import Attempt, StepContext
from fleet.worker.effects import Gate, Reconciled, effect_gate
from fleet.worker.failures import failed, refused, replay_here
from fleet.worker.heartbeat import Heartbeat
from fleet.worker.replay import Replayed, pinned_workflow, replay_run
from fleet.worker.runtime import Runtime
from fleet.worker.views import StepReader

log = logging.getLogger("fleet.attempt")

T = TypeVar("T")


@dataclass(frozen=True)
class Output:
    """What an attempt's body produced, encoded for the store; ``settles``: how the
    intents of earlier attempts end with it (an effect found done by reconcile)."""

    encoded: str
    settles: IntentOutcome | None = None


def execute(rt: Runtime, run_id: str, step_id: str) -> None:
    """Run one attempt of a step if this delivery may; otherwise say why it drops."""
    with log_context(run_id=run_id, step_id=step_id):
        att = take(rt, run_id, step_id)
        if att is None:
            return
        with running(att):
            out = perform(att)
            if out is not None:
                commit(att, out)


def take(rt: Runtime, run_id: str, step_id: str) -> Attempt | None:
    """Take the step's lease for a delivery, if this worker has the run's workflow
    version and the step; a refusal is routed by why (``failures.refused``)."""
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
    # A step naming limits takes room in them first; with none it holds no worker.
    live = not (step.status.finished or run.status.finished)
    if sd.limits and live and not limits_gate.admit(rt, run, step, sd):
        return None
    return _leased(rt, run, step_id, sd)


def _leased(rt: Runtime, run: RunRow, step_id: str, sd: StepDef) -> Attempt | None:
    lease = rt.ledger.take_lease(
        run.id, step_id, rt.worker_name, rt.settings.lease_seconds, run.limited
    )
    if isinstance(lease, TakeRefused):
        if sd.limits:
            limits_gate.refused(rt, run.id, step_id)
        refused(rt, run, step_id, lease)
        return None
    return Attempt(rt, run, sd, lease)


@contextmanager
def running(att: Attempt) -> Iterator[None]:
    """The attempt's log context: every line it logs names its run, step, epoch, attempt."""
    lease = att.lease
    with log_context(
        run_id=lease.run_id, step_id=lease.step_id, epoch=lease.epoch, attempt=lease.attempt
    ):
        log.info(
            "step %s of run %s: attempt %d, epoch %d on %s",
            lease.step_id,
            lease.run_id,
            lease.attempt,
            lease.epoch,
            att.rt.worker_name,
        )
        yield


def perform(att: Attempt) -> Output | None:
    """Run the body under the lease's heartbeat (an effect behind its gate). A failure
    is retried or dead-lettered here; None: nothing to commit."""
    rt, sd, lease = att.rt, att.sd, att.lease
    # Redacting: the secrets this attempt uses never show in what it records or logs.
    proc = process.current()
    # The limits' room is held while the body runs and given back however it ends.
    with limits_gate.holding(att), Heartbeat(rt, lease, proc.beater) as hb, redacting() as redact:
        ctx = StepContext(rt, lease, hb, codec.decode(att.run.pins))
        call = Runner(proc.loop, hb, sd.name)  # an async def on the process's loop
        what = f"output of step {lease.step_id}"
        try:
            # Loaded first: an input that cannot be (PayloadError) is dead-lettered at
            # once, before an effect writes its intent.
            # A transcript in the input is given as a view of it, read on demand.
            with transcripts.reading(StepReader(rt, att.run)):
                args, kwargs = rt.payloads.load_call(lease.input, f"input of step {lease.step_id}")
            redact.watch((args, kwargs))
            gate = effect_gate(att, ctx, call) if sd.effect else Gate.RUN
            if gate is Gate.STOP:
                return None
            if isinstance(gate, Reconciled):
                return Output(rt.payloads.dump(gate.output, what), gate.settles)
            return Output(rt.payloads.dump(call(sd.fn, ctx, *args, **kwargs), what))
        except Exception as exc:
            failure: Exception = exc
        # Outside the except clause: an error recording the failure must not carry the
        # step's exception (and any secret it quotes) into Celery's log.
        limits_gate.on_failure(att, failure)
        failed(att, failure, redact)
        return None


# Called inside the commit's transaction with the runtime bound to it and what the
# replay recorded: returns the steps still to send once it commits, and what the
# caller is handed back.
Claim = Callable[[Runtime, Replayed], tuple[Replayed, T]]


def commit(att: Attempt, out: Output, claim: Claim[T] | None = None) -> T | None:
    """One transaction: commit the output under the epoch held and replay the run
    (recording its next steps); then send what the replay recorded. ``claim`` runs
    inside the transaction and may keep some of it; what it returns on the path that
    committed is returned (None: fenced, or the replay did not run)."""
    rt = att.rt
    try:
        with rt.db.transaction() as tx:
            bound = rt.within(tx)
            done = _commit_output(bound, att, out)
            # Fenced (not done): the attempt's outcome and the incident still commit. A
            # branch whose siblings have not all settled does not replay (not replay).
            replayed = replay_run(bound, att.run_id, done.snapshot) if _replays(done) else None
            kept = _claimed(bound, replayed, claim)
    except CommitUnknown:
        raise  # it may have applied: the store decides when the lease expires
    except Exception as exc:
        # Rolled back whole, so nothing of it applied: commit the step on its own, as
        # one transaction, and replay the run after it.
        log.warning(
            "step %s of run %s: commit with the replay failed (%s); committing it alone",
            att.step_id,
            att.run_id,
            exc,
        )
        return _commit_alone(att, out, claim)
    # Committed: from here on nothing may fall back to committing again.
    if not done:
        _log_fenced(att.lease)
        return None
    _log_done(att.lease)
    return _sent(rt, kept)


def _commit_alone(att: Attempt, out: Output, claim: Claim[T] | None) -> T | None:
    """The fallback: each store call its own transaction (the runtime unbound)."""
    rt = att.rt
    done = _commit_output(rt, att, out)
    if not done:
        _log_fenced(att.lease)
        return None
    _log_done(att.lease)
    replayed = replay_here(rt, att.run_id, done.snapshot) if _replays(done) else None
    return _sent(rt, _claimed(rt, replayed, claim))


def _replays(done: Committed) -> bool:
    """The commit applied and woke the run: not fenced, and not a branch of a fan-out
    whose siblings have not all settled (its last branch replays the run, once)."""
    return done.applied and done.replay


def _claimed(
    rt: Runtime, replayed: Replayed | None, claim: Claim[T] | None
) -> tuple[Replayed | None, T | None]:
    if replayed is None or claim is None:
        return replayed, None
    if any(rt.registry.steps[t.name].limits for t in replayed.tasks if t.name in rt.registry.steps):
        return replayed, None  # a step naming limits is sent: it takes room before its lease
    return claim(rt, replayed)


def _sent(rt: Runtime, kept: tuple[Replayed | None, T | None]) -> T | None:
    replayed, handed = kept
    if replayed is not None and replayed.sends:
        # The broker's round trips (its retries, if it does not answer) off the loop.
        strands.off_the_loop(replayed.send, rt)
    return handed


def _commit_output(rt: Runtime, att: Attempt, out: Output) -> Committed:
    """The step's output, under the epoch held, with the run and history for the
    replay; in ``rt``'s transaction, if it is bound to one."""
    lease = att.lease
    return rt.ledger.commit_output(
        lease.run_id,
        lease.step_id,
        lease.epoch,
        out.encoded,
        earlier_intents=out.settles,
        effect=att.sd.effect,
        snapshot=True,
        created_at=att.run.created_at,
        branch=lease.branch,
    )


def _log_done(lease: Lease) -> None:
    """The attempt's outcome when it committed (Celery's own line is silenced for
    fleet's tasks, ``tasks.QuietSuccess``: it called failed attempts successes)."""
    log.info(
        "step %s of run %s done: attempt %d, epoch %d",
        lease.step_id,
        lease.run_id,
        lease.attempt,
        lease.epoch,
    )


def _log_fenced(lease: Lease) -> None:
    log.warning(
        "fenced: step %s of run %s finished under epoch %d after losing its lease; "
        "its output was discarded",
        lease.step_id,
        lease.run_id,
        lease.epoch,
    )
