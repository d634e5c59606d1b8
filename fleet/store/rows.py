"""Typed rows: what ``Queries`` hands above the store, never a driver's row.

One frozen, slotted dataclass per table read, its fields the table's columns in
the table's order (``from_row`` builds it positionally, the cheapest way: a
replay builds one per step it has not cached; tests/unit/test_states.py checks the
order), with statuses and kinds turned into their enums as it is built, so callers
compare enums, never bare strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.states import (
    AttemptOutcome,
    Decision,
    IntentOutcome,
    RunStatus,
    StepKind,
    StepStatus,
)


@dataclass(frozen=True, slots=True)
class RunRow:
    id: str
    workflow: str
    version: str
    pins: str
    args: str
    queue: str
    status: RunStatus
    result: str | None
    error: str | None
    wake_seq: int
    advanced_seq: int
    redispatch_at: float | None
    dispatches: int
    created_at: float
    updated_at: float
    finished_at: float | None
    budget_tokens: int | None
    budget_cost: float | None
    decision: Decision | None
    parent_id: str | None
    parent_step: str | None
    detached: bool
    tenant: str | None

    @classmethod
    def from_row(cls, row: Any) -> RunRow:
        return cls(*row)

    @property
    def limited(self) -> bool:
        """Whether the run has a spend limit. One created without never gets one (only
        ``raise_budget`` sets them, on a run parked over one)."""
        return self.budget_tokens is not None or self.budget_cost is not None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", RunStatus(self.status))
        if self.decision is not None:
            object.__setattr__(self, "decision", Decision(self.decision))


@dataclass(frozen=True, slots=True)
class StepRow:
    run_id: str
    step_id: str
    seq: int
    name: str
    kind: StepKind
    input: str
    status: StepStatus
    output: str | None
    error: str | None
    attempts: int
    max_attempts: int
    epoch: int
    lease_owner: str | None
    lease_expires_at: float | None
    due_at: float | None
    redispatch_at: float | None
    dispatches: int
    created_at: float
    finished_at: float | None
    fanout: int | None

    @classmethod
    def from_row(cls, row: Any) -> StepRow:
        return cls(*row)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StepKind(self.kind))
        object.__setattr__(self, "status", StepStatus(self.status))


@dataclass(frozen=True, slots=True)
class AttemptRow:
    run_id: str
    step_id: str
    epoch: int
    attempt: int
    worker: str
    outcome: AttemptOutcome
    error: str | None
    started_at: float
    finished_at: float | None
    model: str | None
    calls: int
    input_tokens: int
    output_tokens: int
    cost: float

    @classmethod
    def from_row(cls, row: Any) -> AttemptRow:
        return cls(*row)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", AttemptOutcome(self.outcome))


@dataclass(frozen=True, slots=True)
class IntentRow:
    run_id: str
    step_id: str
    epoch: int
    idempotency_key: str
    input_hash: str
    outcome: IntentOutcome
    created_at: float
    settled_at: float | None

    @classmethod
    def from_row(cls, row: Any) -> IntentRow:
        return cls(*row)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", IntentOutcome(self.outcome))


@dataclass(frozen=True, slots=True)
class DeadLetterRow:
    id: int
    run_id: str
    step_id: str
    workflow: str
    name: str
    input: str
    error_type: str
    error_message: str
    traceback: str | None
    attempts: int
    first_failed_at: float
    last_failed_at: float
    replayed_at: float | None

    @classmethod
    def from_row(cls, row: Any) -> DeadLetterRow:
        return cls(*row)


@dataclass(frozen=True, slots=True)
class Figures:
    """Fleet-wide figures for the metrics endpoint (``Queries.figures``)."""

    runs: dict[str, int]  # by status
    attempts: dict[str, int]  # by outcome
    incidents: dict[str, int]  # by kind
    dead_letters: int
    dead_letters_outstanding: int
    waits_open: int
    duration_buckets: list[int]  # cumulative, one per bucket asked for
    duration_count: int
    duration_sum: float
    spend: list[tuple[str, str, int, int, float]]  # workflow, model, in, out, cost
    live_queues: list[str]
