"""``RunHandle``: what ``Fleet.enqueue`` and ``Fleet.run`` return. It holds a run id
only and reads the store on every call, so a handle is never stale and costs nothing
to keep. Its ``a``-methods are for callers on an event loop (``fleet.aio_client``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from fleet.errors import RunFailed, UnknownRun, WaitTimeout
from fleet.records import StepInfo, WaitInfo
from fleet.states import RunStatus, StepKind, StepStatus

if TYPE_CHECKING:
    from fleet.store.rows import RunRow
    from fleet.worker.runtime import Runtime


class Owner(Protocol):
    """What a handle reads through: the ``Fleet`` it came from (named by what it
    offers, so this module needs nothing of ``fleet.app``)."""

    @property
    def runtime(self) -> Runtime: ...

    @property
    def waiters(self) -> Any: ...  # fleet.aio_client.Waiters

    @property
    def off_loop(self) -> Any: ...  # fleet.aio_client.OffLoop


WAIT_POLL_MAX = 0.5  # a wait's reads slow down to one each this many seconds


def slower(delay: float) -> float:
    """The pause before a wait's next read: half as long again, up to ``WAIT_POLL_MAX``."""
    return min(delay * 1.5, WAIT_POLL_MAX)


def verdict(
    run_id: str,
    status: RunStatus,
    error: str | None,
    result: Callable[[], Any],
    deadline: float | None,
    timeout: float | None,
    now: float,
) -> tuple[bool, Any]:
    """What one look at a run tells a wait (``RunHandle.wait``, and ``aresult``'s shared
    reads): ``(True, result())`` once it succeeded, ``RunFailed`` once it ended
    otherwise, ``WaitTimeout`` at or past ``deadline``, else ``(False, None)``."""
    if status == RunStatus.SUCCEEDED:
        return True, result()
    if status.finished:
        raise RunFailed(run_id, status.value, error)
    if deadline is not None and now >= deadline:
        raise WaitTimeout(f"run {run_id} still {status.value} after {timeout}s")
    return False, None


class RunHandle:
    """A handle on one run, read from the store on every call."""

    def __init__(self, fleet: Owner, run_id: str) -> None:
        self._fleet = fleet
        self.id = run_id

    def __repr__(self) -> str:
        return f"RunHandle({self.id!r})"

    def row(self) -> RunRow:
        """The run's row as the store holds it now; ``UnknownRun`` if there is none."""
        row = self._fleet.runtime.queries.run(self.id)
        if row is None:
            raise UnknownRun(f"unknown run id {self.id!r}")
        return row

    def status(self) -> str:
        return str(self.row().status)

    def wait(self, timeout: float | None = 60.0, poll: float = 0.05) -> Any:
        """Block until the run ends: its return value, or ``RunFailed``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = poll
        while True:
            ended, value = self._ended(deadline, timeout)
            if ended:
                return value
            time.sleep(delay)
            delay = slower(delay)

    async def aresult(self, timeout: float | None = 60.0, poll: float = 0.05) -> Any:
        """``wait``, awaited: the run's return value, ``RunFailed`` or ``WaitTimeout``.
        It waits on the loop with the Fleet's other waiters, whose runs are read in one
        statement per round (``fleet.aio_waiters``): it holds no thread while waiting."""
        return await self._fleet.waiters.result(self.id, timeout, poll)

    def _ended(self, deadline: float | None, timeout: float | None) -> tuple[bool, Any]:
        """One look at the run: ``(True, result)`` once it succeeded, ``RunFailed`` once
        it ended otherwise, ``WaitTimeout`` past ``deadline``, else ``(False, None)``."""
        row = self.row()
        load = self._fleet.runtime.payloads.load
        status, now = RunStatus(row.status), time.monotonic()
        return verdict(self.id, status, row.error, lambda: load(row.result), deadline, timeout, now)

    async def astatus(self) -> str:
        """``status``, awaited: read with the Fleet's waiters on this loop, in one
        statement for all of them."""
        return await self._fleet.waiters.status(self.id)

    async def asteps(self) -> list[StepInfo]:
        """``steps``, awaited."""
        return await self._fleet.off_loop.call(self.steps)

    def steps(self) -> list[StepInfo]:
        return [
            StepInfo(s.step_id, s.name, s.status, s.attempts, s.epoch, s.error)
            for s in self._fleet.runtime.queries.steps(self.id)
            if s.kind == StepKind.TASK
        ]

    def waits(self) -> list[WaitInfo]:
        """The run's open ``wait_for`` waits, earliest first: each one's id answers it
        alone (``Fleet.signal(..., wait_id=id)``); a sleep is not listed."""
        self.row()
        return [
            WaitInfo(s.step_id, s.name.removeprefix("wait:"), s.created_at, s.due_at)
            for s in self._fleet.runtime.queries.steps(self.id)
            if s.kind == StepKind.WAIT
            and s.status == StepStatus.PENDING
            and s.name.startswith("wait:")
        ]

    def usage(self) -> dict[str, Any]:
        """Calls, tokens and cost recorded by the run's steps, every attempt included."""
        self.row()
        return self._fleet.runtime.queries.usage(self.id)
