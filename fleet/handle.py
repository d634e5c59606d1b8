"""``RunHandle``: what ``Fleet.enqueue`` and ``Fleet.run`` return. It holds a run id
only and reads the store on every call, so a handle is never stale and costs nothing
to keep."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fleet.errors import RunFailed, UnknownRun, WaitTimeout
from fleet.records import StepInfo
from fleet.states import RunStatus, StepKind

if TYPE_CHECKING:
    from fleet.app import Fleet


class RunHandle:
    """A handle on one run, read from the store on every call."""

    def __init__(self, fleet: Fleet, run_id: str) -> None:
        self._fleet = fleet
        self.id = run_id

    def __repr__(self) -> str:
        return f"RunHandle({self.id!r})"

    def _row(self) -> Any:
        row = self._fleet.runtime.queries.run(self.id)
        if row is None:
            raise UnknownRun(f"unknown run id {self.id!r}")
        return row

    def status(self) -> str:
        return str(self._row().status)

    def wait(self, timeout: float | None = 60.0, poll: float = 0.05) -> Any:
        """Block until the run ends: its return value, or ``RunFailed``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = poll
        while True:
            row = self._row()
            status = RunStatus(row.status)
            if status == RunStatus.SUCCEEDED:
                return self._fleet.runtime.payloads.load(row.result)
            if status.finished:
                raise RunFailed(self.id, status.value, row.error)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"run {self.id} still {status.value} after {timeout}s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def steps(self) -> list[StepInfo]:
        return [
            StepInfo(s.step_id, s.name, s.status, s.attempts, s.epoch, s.error)
            for s in self._fleet.runtime.queries.steps(self.id)
            if s.kind == StepKind.TASK
        ]

    def usage(self) -> dict[str, Any]:
        """Calls, tokens and cost recorded by the run's steps, every attempt included."""
        self._row()
        return self._fleet.runtime.queries.usage(self.id)
