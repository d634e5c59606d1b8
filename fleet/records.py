"""Plain records the public API returns (rows from the store, without the store)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepInfo:
    id: str
    name: str
    status: str
    attempts: int
    epoch: int
    error: str | None


@dataclass(frozen=True)
class DeadLetterInfo:
    """A dead-lettered step: everything an operator needs to decide what to do."""

    id: int
    run_id: str
    step_id: str
    workflow: str
    step_name: str
    input: Any
    error_type: str
    error_message: str
    traceback: str | None
    attempts: int
    first_failed_at: float
    last_failed_at: float
    replayed_at: float | None

    @property
    def error(self) -> str:
        return f"{self.error_type}: {self.error_message}"

    @classmethod
    def from_row(cls, row: Any, load: Callable[[str], Any]) -> DeadLetterInfo:
        """``load`` reads a recorded value (``Payloads.load``: inline or by reference)."""
        return cls(
            id=row.id,
            run_id=row.run_id,
            step_id=row.step_id,
            workflow=row.workflow,
            step_name=row.name,
            input=load(row.input),
            error_type=row.error_type,
            error_message=row.error_message,
            traceback=row.traceback,
            attempts=row.attempts,
            first_failed_at=row.first_failed_at,
            last_failed_at=row.last_failed_at,
            replayed_at=row.replayed_at,
        )
