"""Plain records the public API returns (rows from the store, without the store)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.errors import PayloadError
from fleet.states import AttemptOutcome


@dataclass(frozen=True)
class StepInfo:
    id: str
    name: str
    status: str
    attempts: int
    epoch: int
    error: str | None


@dataclass(frozen=True)
class WaitInfo:
    """An open ``wf.wait_for(name)`` of a run (``RunHandle.waits``): ``id`` is what
    ``Fleet.signal(run_id, name, data, wait_id=id)`` answers, and only that wait.
    ``since`` and ``timeout_at`` are epoch seconds (``timeout_at`` None: no timeout)."""

    id: str
    name: str
    since: float
    timeout_at: float | None


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
        """``load`` reads a recorded value (``Payloads.load``: inline or by reference).
        An input that cannot be loaded (a corrupt row) is given as None: the letter is
        still listed, shown and replayable, and its error says why when that was it."""
        try:
            input_ = load(row.input)
        except PayloadError:
            input_ = None
        return cls(
            id=row.id,
            run_id=row.run_id,
            step_id=row.step_id,
            workflow=row.workflow,
            step_name=row.name,
            input=input_,
            error_type=row.error_type,
            error_message=row.error_message,
            traceback=row.traceback,
            attempts=row.attempts,
            first_failed_at=row.first_failed_at,
            last_failed_at=row.last_failed_at,
            replayed_at=row.replayed_at,
        )


def attempts_by_step(attempts: Sequence[Any]) -> dict[str, list[Any]]:
    """Attempt rows grouped by step id, in the order given."""
    grouped: dict[str, list[Any]] = {}
    for a in attempts:
        grouped.setdefault(a.step_id, []).append(a)
    return grouped


def saved_by_resume(attempts: Sequence[Any]) -> dict[str, Any]:
    """What checkpoints saved: for each attempt lost with its worker or fenced (a crash
    or a takeover), the steps already checkpointed at that moment and what they had
    spent: what a restart from step one would have spent again. Summed over crashes."""
    done = [a for a in attempts if a.outcome == AttemptOutcome.DONE and a.finished_at is not None]
    saved: dict[str, Any] = {"crashes": 0, "steps": 0, "calls": 0, "tokens": 0, "cost": 0.0}
    for lost in (a for a in attempts if a.outcome in (AttemptOutcome.LOST, AttemptOutcome.FENCED)):
        # The moment of the crash as the store saw it: when another attempt took over.
        takeover = next(
            (
                a.started_at
                for a in attempts
                if a.step_id == lost.step_id and a.epoch == lost.epoch + 1
            ),
            lost.finished_at or lost.started_at,
        )
        before = [d for d in done if d.finished_at <= takeover]
        saved["crashes"] += 1
        saved["steps"] += len({d.step_id for d in before})
        saved["calls"] += sum(d.calls for d in before)
        saved["tokens"] += sum(d.input_tokens + d.output_tokens for d in before)
        saved["cost"] += sum(d.cost for d in before)
    return saved


@dataclass(frozen=True, slots=True)
class DeadMessageInfo:
    """A broker message a worker refused and set aside (``Fleet.dead_messages``): the
    queue it came on, why it was refused, its raw text (clipped), when. Its fields are
    the ``fleet_dead_messages`` columns in their order (tests/unit/test_states.py)."""

    id: int
    queue: str
    reason: str
    body: str
    at: float

    @classmethod
    def from_row(cls, row: Any) -> DeadMessageInfo:
        return cls(*row)


@dataclass(frozen=True)
class Replay:
    """What a recorded run's workflow does when replayed over its history in the
    caller's process (``fleet.testing.replay``), no step body executed.

    ``status``: ``"finished"`` (it returned ``result``, as the run records it),
    ``"failed"`` (it raised: ``error`` as the run records it), or ``"suspended"`` (it
    stands before steps not finished: ``next``, their ids in order; ``wait``: the signal
    it waits for, when that is a ``wf.wait_for``). ``new``: those of ``next`` the
    history does not hold yet (an advance would record them now). ``replayed``: how many
    recorded steps the replay met."""

    run_id: str
    status: str
    result: Any = None
    error: str | None = None
    next: tuple[str, ...] = ()
    wait: str | None = None
    new: tuple[str, ...] = ()
    replayed: int = 0
