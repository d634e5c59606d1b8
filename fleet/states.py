"""Run and step statuses, mirrored by CHECK constraints in the schema.

Allowed transitions (each one is a single conditional write in ``store.ledger``):

run:   queued → running                (first advance)
       running → succeeded | failed     (workflow returned | raised, or non-determinism)
       queued | running → cancelled
step:  pending → running                (lease taken: epoch+1, attempts+1)
       running → running                (lease expired, taken over: epoch+1, attempts+1)
       running → done                   (commit WHERE epoch = held)
       running → retry_wait → running   (due time in the store)
       running → dead                   (cap reached or non-retryable → dead letter)
       pending | retry_wait | running → dead   (attempt cap already spent by crashes)
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
    DONE = "done"
    DEAD = "dead"

    @property
    def finished(self) -> bool:
        return self in (StepStatus.DONE, StepStatus.DEAD)


class StepKind(StrEnum):
    TASK = "task"  # executed by a worker
    VALUE = "value"  # recorded inline during replay: wf.now(), wf.random()


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


def check_constraint(column: str, enum: type[StrEnum]) -> str:
    values = ", ".join(f"'{v.value}'" for v in enum)
    return f"{column} IN ({values})"
