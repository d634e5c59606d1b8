"""Run and step statuses, mirrored by CHECK constraints in the schema, and the
transitions allowed between them.

``TRANSITIONS`` is the truth: each entry is one conditional statement in
``fleet/store/transitions.py``, whose ``WHERE status IN (sources)`` and
``SET status = target`` are built from the entry, and one test of the same name in
``tests/integration/test_transitions.py``. In short: a run goes queued → running,
waits and wakes (running ⇄ waiting), may stop for a person (needs_decision) and
ends succeeded, failed or cancelled; a failed run comes back when one of its dead
letters is replayed. A task step goes pending → running (a lease) → done, or into
retry_wait, dead or in_doubt; wait steps (wait_for, sleep) go pending → done; a child
step (wf.child) goes pending → done or dead when its child run ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    NEEDS_DECISION = "needs_decision"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


class StepStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    RETRY_WAIT = "retry_wait"
    IN_DOUBT = "in_doubt"
    DONE = "done"
    DEAD = "dead"

    @property
    def finished(self) -> bool:
        return self in (StepStatus.DONE, StepStatus.DEAD)


class StepKind(StrEnum):
    TASK = "task"  # executed by a worker
    VALUE = "value"  # recorded inline during replay: wf.now(), wf.random()
    WAIT = "wait"  # wf.wait_for() and wf.sleep(): settled by a signal or the sweeper
    CHILD = "child"  # wf.child(), wf.start_child(): settled when the child run ends


class AttemptOutcome(StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # raised; retried or dead-lettered
    FENCED = "fenced"  # finished after losing its lease: commit rejected
    LOST = "lost"  # the worker vanished; the lease was taken over


class Incident(StrEnum):
    """Fleet-wide counters kept in the store, so they are right however many workers run."""

    FENCED_WRITE = "fenced_write"
    DUPLICATE_DELIVERY = "duplicate_delivery"
    TAKEOVER = "takeover"
    NONDETERMINISM = "nondeterminism"
    UNKNOWN_STEP = "unknown_step"
    MALFORMED_MESSAGE = "malformed_message"
    VERSION_MISMATCH = "version_mismatch"
    EFFECT_IN_DOUBT = "effect_in_doubt"


def check_constraint(column: str, enum: type[StrEnum]) -> str:
    values = ", ".join(f"'{v.value}'" for v in enum)
    return f"{column} IN ({values})"


class IntentOutcome(StrEnum):
    """How a write-ahead intent of an effect step ended. OPEN: the attempt may have
    acted and never said (crashed, or fenced while running): in doubt."""

    OPEN = "open"
    DONE = "done"  # the attempt committed its checkpoint
    FAILED = "failed"  # the step raised: it reports the effect did not happen
    RECONCILED = "reconciled"  # the reconcile hook found it had happened
    RESOLVED = "resolved"  # a person settled it (fleet.resolve)
    SUPERSEDED = "superseded"  # retried (idempotent, reconcile said no, or resolve --retry)


class Decision(StrEnum):
    """Why a run in needs_decision waits for a person."""

    EFFECT = "effect"  # an effect in doubt: fleet resolve RUN STEP (--output | --retry)
    BUDGET = "budget"  # its spend reached its budget: fleet resolve RUN --raise-budget


@dataclass(frozen=True, slots=True)
class Transition:
    """One allowed status change: of a ``subject`` (a run or a step) from any of
    ``sources`` to ``target``, made by the store statement named ``name``."""

    name: str
    subject: Literal["run", "step"]
    sources: frozenset[str]
    target: str
    why: str


def _run(name: str, sources: tuple[RunStatus, ...], target: RunStatus, why: str) -> Transition:
    return Transition(name, "run", frozenset(sources), target, why)


def _step(name: str, sources: tuple[StepStatus, ...], target: StepStatus, why: str) -> Transition:
    return Transition(name, "step", frozenset(sources), target, why)


R, S = RunStatus, StepStatus
LIVE_RUN = (R.QUEUED, R.RUNNING, R.WAITING, R.NEEDS_DECISION)
TAKEABLE = (S.PENDING, S.RETRY_WAIT, S.RUNNING)  # running: only once its lease expired


def _table(*entries: Transition) -> dict[str, Transition]:
    table = {t.name: t for t in entries}
    if len(table) != len(entries):
        raise ValueError("two transitions share a name")
    return table


TRANSITIONS: dict[str, Transition] = _table(
    _run("start_run", (R.QUEUED,), R.RUNNING, "its first advance"),
    _run("set_waiting", (R.RUNNING,), R.WAITING, "a replay stopped at wait_for or sleep"),
    _run("resume_run", (R.WAITING,), R.RUNNING, "a signal or a timer"),
    _run("succeed_run", (R.RUNNING,), R.SUCCEEDED, "the workflow returned"),
    _run("fail_run", (R.RUNNING,), R.FAILED, "it raised, or was not deterministic"),
    _run("cancel_run", LIVE_RUN, R.CANCELLED, "fleet cancel; its parent cancelled or ended"),
    _run("park_run_in_doubt", (R.RUNNING,), R.NEEDS_DECISION, "an effect in doubt"),
    _run("park_over_budget", (R.RUNNING,), R.NEEDS_DECISION, "spend reached its budget"),
    _run("resolve_run", (R.NEEDS_DECISION,), R.RUNNING, "fleet resolve"),
    _run("raise_budget", (R.NEEDS_DECISION,), R.RUNNING, "a budget raised"),
    # running stays running: a second replay of a running run's letter is harmless.
    _run("replay_run", (R.FAILED, R.RUNNING), R.RUNNING, "a dead letter replayed"),
    _step("take_lease", TAKEABLE, S.RUNNING, "lease taken: epoch+1, attempts+1"),
    _step("commit_output", (S.RUNNING,), S.DONE, "committed under the epoch held"),
    _step("schedule_retry", (S.RUNNING,), S.RETRY_WAIT, "raised; due time in the store"),
    _step("dead_letter", (S.RUNNING,), S.DEAD, "cap reached or not retryable"),
    _step("dead_letter_exhausted", TAKEABLE, S.DEAD, "cap already spent by crashes"),
    _step("park_in_doubt", (S.RUNNING,), S.IN_DOUBT, "an earlier attempt may have acted"),
    _step("resolve_done", (S.IN_DOUBT,), S.DONE, "fleet resolve with an output"),
    _step("resolve_retry", (S.IN_DOUBT,), S.PENDING, "fleet resolve --retry"),
    _step("replay_step", (S.DEAD,), S.PENDING, "its dead letter replayed"),
    _step("revoke_lease", (S.RUNNING,), S.PENDING, "run cancelled or ended: epoch+1"),
    _step("deliver_signal", (S.PENDING,), S.DONE, "a wait_for given its signal"),
    _step("fire_due_wait", (S.PENDING,), S.DONE, "a wait's timeout or a sleep's end"),
    _step("settle_child_done", (S.PENDING,), S.DONE, "its child run succeeded"),
    _step("settle_child_dead", (S.PENDING,), S.DEAD, "its child run failed or was cancelled"),
)
del R, S  # short names for the table above only
