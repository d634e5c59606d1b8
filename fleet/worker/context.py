"""One attempt's context: what the engine holds while it runs (``Attempt``: the run,
the step's definition, the lease), and what the step function is given (``StepContext``,
see CONTRACT.md; ``LeaseLost`` when another attempt has taken the step over)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fleet.errors import FleetError
from fleet.registry import StepDef
from fleet.store.ledger import Lease
from fleet.store.rows import RunRow
from fleet.worker.heartbeat import Heartbeat
from fleet.worker.runtime import Runtime


@dataclass(frozen=True)
class Attempt:
    """One attempt of one step whose lease this worker holds: what each part of the
    attempt (body, effect gate, commit, failure routing) works on."""

    rt: Runtime
    run: RunRow  # as read when the lease was taken
    sd: StepDef
    lease: Lease

    @property
    def run_id(self) -> str:
        return self.lease.run_id

    @property
    def step_id(self) -> str:
        return self.lease.step_id


class LeaseLost(FleetError):
    """This attempt's lease was taken over or revoked; its result will not be recorded."""


class StepContext:
    """The first argument of a step function (see CONTRACT.md)."""

    def __init__(
        self, rt: Runtime, lease: Lease, heartbeat: Heartbeat, pins: dict[str, Any] | None = None
    ) -> None:
        self.run_id = lease.run_id
        self.step_id = lease.step_id
        self.attempt = lease.attempt
        self.epoch = lease.epoch
        self.idempotency_key = f"{lease.run_id}:{lease.step_id}"
        # The run's pins (its model, where declared): what a resumed history must keep.
        self.pins: dict[str, Any] = dict(pins or {})
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

    async def arecord_usage(
        self,
        model: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cost: float = 0.0,
    ) -> None:
        """``record_usage`` for an ``async def`` step: the same write, awaited, made on
        the loop's executor so the loop serves the process's other steps meanwhile."""
        await asyncio.to_thread(self.record_usage, model, input_tokens, output_tokens, cost)
