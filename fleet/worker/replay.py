"""Replaying a workflow over its recorded checkpoints (the ``advance`` of a run).

The workflow function runs from the top on every advance (``WorkflowContext``,
fleet/worker/workflow.py), so a run resumes at its first unfinished step, whichever
worker replays it; where this thread keeps the run's workflow parked from its last
advance (fleet/worker/live.py), it is resumed where it stood instead, which is the
same. This module drives it: checks the pin, starts or resumes the run, and records
where the replay stopped (its next steps, its wait, or its end).

The replay records and never sends: ``replay_run`` returns the new task steps it
recorded (``Replayed``) and its caller sends them once what recorded them has
committed. ``advance`` is the plain case: replay, then send them all.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field

from fleet import codec
from fleet.errors import (
    LimitExceeded,
    NonDeterminism,
    PayloadError,
    StepFailed,
    StoreUnavailable,
)
from fleet.logs import log_context
from fleet.registry import WorkflowDef
from fleet.secrets import Redactor, redacting
from fleet.states import Incident, RunStatus
from fleet.store.ledger import NewChild
from fleet.store.queries import Snapshot
from fleet.store.rows import RunRow
from fleet.worker import live as lives
from fleet.worker.runtime import Runtime
from fleet.worker.workflow import PARKED, NewTask, Suspend, WorkflowContext

log = logging.getLogger("fleet.replay")


def step_shadow(workflow: str, name: str) -> str:
    """The name a step task shows in Flower and logs: ``research.answer``, from the
    step's registered name, never its id (ids hold positions, keys and tool-call ids:
    one Flower series per id would grow without bound)."""
    return f"{workflow}.{name}"


@dataclass
class Replayed:
    """What a replay recorded that must be sent: its new task steps, in order, the
    child runs it started, and the parent its end woke. Send them only once the
    transaction that recorded them has committed (a worker given a step or run the
    store does not have yet drops it, and the sweeper sends it late)."""

    # The run's row as the replay read it (before the replay moved it on): where its
    # messages go, and what an attempt of a step it recorded needs of its run (pins,
    # tenant, creation time).
    run: RunRow
    tasks: list[NewTask] = field(default_factory=list)
    children: list[NewChild] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)

    @property
    def sends(self) -> bool:
        """Whether ``send`` has anything to send."""
        return bool(self.tasks or self.children or self.parents)

    def send(self, rt: Runtime) -> None:
        """One message per new task step, one advance per new child run and per parent
        to wake; a failure to send is the sweeper's to repair."""
        for task in self.tasks:
            rt.dispatcher.execute(
                self.run.id,
                task.step_id,
                self.run.queue,
                shadow=step_shadow(self.run.workflow, task.name),
            )
        for child in self.children:
            rt.dispatcher.advance(child.run_id, child.queue)
        for parent_id in self.parents:
            parent = rt.queries.run(parent_id)
            if parent is not None:
                rt.dispatcher.advance(parent_id, parent.queue)


def pinned_workflow(rt: Runtime, run: RunRow, step_id: str | None = None) -> WorkflowDef | None:
    """The workflow the run is pinned to, if this worker has that version and pins;
    otherwise None, with the mismatch counted and logged (never silent)."""
    wf = rt.registry.workflows.get(run.workflow)
    if wf is not None and wf.pinned_to(run.version, codec.decode(run.pins) or {}):
        return wf
    have = f"version {wf.version} pins {dict(wf.pins)}" if wf else "no such workflow"
    detail = (
        f"run needs {run.workflow} version {run.version} pins {run.pins} "
        f"(queue {run.queue}); this worker has {have}"
    )
    rt.ledger.incident(
        Incident.VERSION_MISMATCH, run.id, step_id, worker=rt.worker_name, detail=detail
    )
    log.warning("%s: left for a worker that has it", detail)
    return None


def advance(rt: Runtime, run_id: str, snapshot: Snapshot | None = None) -> None:
    """Replay the run and act on where it stands, then send the step(s) it recorded:
    what the ``fleet.advance`` task does. Safe to run concurrently and repeatedly."""
    replayed = replay_run(rt, run_id, snapshot)
    if replayed is not None:
        replayed.send(rt)


def replay_run(rt: Runtime, run_id: str, snapshot: Snapshot | None = None) -> Replayed | None:
    """Replay the run and record where it stands: its next step(s), its wait, or its
    end. Returns the new task steps to send (None: the run was not replayed); sends
    nothing. ``snapshot``: the run and its history, if the caller has just read them."""
    # Redacting: a secret the workflow reveals never shows in the run's error or logs.
    with log_context(run_id=run_id), redacting() as redact:
        return _replay(rt, run_id, snapshot or rt.queries.snapshot(run_id), redact)


# A replay runs only for a run that may move on: finished, cancelled and parked runs
# wait for something other than a replay.
_REPLAYABLE = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING})


def _replay(
    rt: Runtime, run_id: str, snapshot: Snapshot | None, redact: Redactor
) -> Replayed | None:
    if snapshot is None:
        rt.ledger.incident(
            Incident.MALFORMED_MESSAGE, None, detail=f"advance of unknown run {run_id!r}"
        )
        log.warning("advance for unknown run %r dropped", run_id)
        return None
    run, history = snapshot
    status = RunStatus(run.status)
    if status not in _REPLAYABLE:
        if status.finished:
            lives.RUNS.discard(run_id)
        return None
    wf = pinned_workflow(rt, run)
    if wf is None:
        return None
    live = lives.RUNS.take(rt, run, history, wf)
    if live is not None:
        ctx = live.ctx
        ctx.rebind(rt, run, history)
    else:
        ctx = WorkflowContext(rt, run, history)
    # Whether the replay suspends, returns or raises, what it recorded is to be sent.
    replayed = Replayed(run, ctx.new_tasks, ctx.new_children)
    # Where each store call commits on its own (SQLite; an advance's fallback after
    # its one transaction failed), the run moves on first: had the replay recorded its
    # steps and the run been marked advanced before a failed start, the run would stay
    # queued with nothing to re-send it (the sweeper re-sends a run's advance only
    # until it is marked advanced, and a step only once its run is running).
    bound = rt.ledger.tx is not None
    if not bound:
        rt.ledger.begin_replay(run_id, status)
    try:
        try:
            if live is None:
                # Arguments that cannot be loaded fail the run (PayloadError), once.
                args, kwargs = rt.payloads.load_call(run.args, f"arguments of run {run_id}")
                live = lives.start(rt, wf, ctx, args, kwargs)
            else:
                args, kwargs = live.args, live.kwargs
                for value in live.revealed:
                    redact.add(value)
            redact.watch((args, kwargs))
            result = wf.fn(ctx, *args, **kwargs) if live is None else live.run()
            if result is PARKED:
                raise Suspend
            check_all_replayed(ctx)
        finally:
            # In one transaction the run moves on (queued or waiting → running) once the
            # workflow has run, first of the replay's writes: nothing is locked while the
            # workflow runs (a worker frozen in it blocks no other advance).
            if bound:
                rt.ledger.begin_replay(run_id, status)
        encoded = rt.payloads.dump(result, what=f"result of run {run_id}")
        ctx.flush()
    except Suspend:
        ctx.flush()
        if ctx.waiting:
            rt.ledger.set_waiting(run_id, run.wake_seq)
        if not ctx.answered:
            rt.ledger.mark_advanced(run_id, run.wake_seq)
        if live is not None:
            live.revealed = redact.revealed()
            lives.keep_once_committed(rt, live)
        return replayed
    except NonDeterminism as exc:
        # What it appended before the mismatch is not written: the history stays as it was.
        rt.ledger.incident(Incident.NONDETERMINISM, run_id, detail=str(exc))
        log.error("%s", exc)
        _fail(rt, run_id, redact(error_text(exc)))
    except StoreUnavailable:
        raise  # the sweeper will advance the run again once the store answers
    except Exception as exc:
        _fail(rt, run_id, redact(error_text(exc)), ctx)
    else:
        rt.ledger.finish_run(run_id, RunStatus.SUCCEEDED, result=encoded)
    rt.ledger.mark_advanced(run_id, run.wake_seq)
    if run.parent_id is not None:  # it ended: its parent's child step has its outcome
        replayed.parents.append(run.parent_id)
    return replayed


def error_text(exc: Exception) -> str:
    """The error a run records when its workflow raised ``exc`` (called where it is
    handled: an unexpected exception's text ends with its traceback)."""
    if isinstance(exc, StepFailed):
        return f"StepFailed: {exc}"  # a ChildFailed or BranchesFailed too
    if isinstance(exc, NonDeterminism | PayloadError | LimitExceeded):
        return f"{type(exc).__name__}: {exc}"
    error = "".join(traceback.format_exception_only(exc)).strip()
    return f"{error}\n\n{traceback.format_exc()}"


def check_all_replayed(ctx: WorkflowContext) -> None:
    """A workflow that returned must have met every recorded step and message."""
    unmet = ctx.unreplayed() or ctx.talk.unfinished()
    if unmet:
        raise NonDeterminism(unmet)


def _fail(rt: Runtime, run_id: str, error: str, ctx: WorkflowContext | None = None) -> None:
    """The run failed; what its workflow said before it raised is kept (``ctx``)."""
    if ctx is not None:
        ctx.flush()
    log.info("run %s failed: %s", run_id, error.partition("\n")[0])
    rt.ledger.finish_run(run_id, RunStatus.FAILED, error=error)
