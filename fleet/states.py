"""Run and step statuses, mirrored by CHECK constraints in the schema.

Allowed transitions (each one is a single conditional write in ``store.ledger``):

run:   queued → running                (first advance)
       running ⇄ waiting                (a replay stopped at wait_for/sleep | a signal or timer)
       running → needs_decision → running   (an in-doubt effect | fleet.resolve)
       running → succeeded | failed     (workflow returned | raised, or non-determinism)
       failed → running                 (one of its dead letters replayed)
       queued | running | waiting | needs_decision → cancelled
step:  pending → running                (lease taken: epoch+1, attempts+1)
       running → running                (lease expired, taken over: epoch+1, attempts+1)
       running → done                   (commit WHERE epoch = held)
       running → retry_wait → running   (due time in the store)
       running → dead                   (cap reached or non-retryable → dead letter)
       pending | retry_wait | running → dead   (attempt cap already spent by crashes)
       running → in_doubt               (an effect's earlier attempt may have acted)
       in_doubt → done | pending        (fleet.resolve: output given | retry ordered)
       dead → pending                   (dead letter replayed)
       running → pending                (run cancelled: lease revoked, epoch+1)
wait steps (kind "wait": wait_for and sleep): pending → done (signal, or due time reached)
"""

from __future__ import annotations

from enum import StrEnum


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
