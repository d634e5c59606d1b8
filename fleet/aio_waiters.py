"""The async client's shared waiters (``fleet.aio_client``): every ``aresult`` and
``astatus`` of one ``Fleet`` on one event loop shares one poller, which reads all the
runs they wait on in one statement per round (``WHERE id IN (...)``) and wakes each
waiter when its run ends. N waiters cost one read per round, not N; a waiter is a
future on the caller's loop, so it holds no thread, and no thread ever blocks on a
wait (each read is one short call on the Fleet's pool, beside the other calls). A
cancelled waiter (its caller gone, ``asyncio.wait_for``'s timeout) is dropped at once.

Each decides what ``RunHandle.wait`` decides from its own read, by the same functions
(``fleet.handle.verdict``, ``slower``): ``UnknownRun``, the result, ``RunFailed``, then
``WaitTimeout`` once a read at or past its deadline still shows the run going; its
reads slow down as ``wait``'s do.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fleet.errors import UnknownRun
from fleet.handle import slower, verdict
from fleet.states import RunStatus

if TYPE_CHECKING:
    from fleet.worker.runtime import Runtime

T = TypeVar("T")

# Callers woken per turn of their loop: woken together (a batch, a shared read), each
# resumes its own work (a web request's response), and a hundred of them in one turn
# would keep the loop from anything else as long (bench/RESULTS.md §9).
SETTLE_AT_ONCE = 8


class _OffLoop(Protocol):
    async def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T: ...


class Client(Protocol):
    """What the waiters need of a ``Fleet``: its pool of threads and its store."""

    @property
    def off_loop(self) -> _OffLoop: ...

    @property
    def runtime(self) -> Runtime: ...


@dataclass(eq=False)
class _Waiter:
    """One ``aresult`` on one loop (with ``once``: one ``astatus``, settled by the
    first read). ``due``: when it wants its next read; ``delay`` grows as ``wait``'s."""

    run_id: str
    future: asyncio.Future[Any]
    once: bool = False
    deadline: float | None = None
    timeout: float | None = None
    delay: float = 0.05
    due: float = field(default_factory=time.monotonic)


# What one shared read saw of each run: its status and, for a succeeded run a waiter
# wants the result of, that result (or the error loading it).
_Seen = dict[str, tuple[RunStatus, str | None, Any, BaseException | None]]


class _Poller:
    """The waiters of one event loop and the task that reads their runs, one read for
    all of them per round; the task ends (and forgets this poller) when none is left."""

    def __init__(self, client: Client, forget: Callable[[_Poller], None]) -> None:
        self._client = client
        self._forget = forget
        self.waiters: set[_Waiter] = set()
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None

    def add(self, waiter: _Waiter) -> None:
        """Wait with the others; read at once (with any other newcomer) if idle."""
        self.waiters.add(waiter)
        waiter.future.add_done_callback(lambda _: self.waiters.discard(waiter))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _run(self) -> None:
        try:
            while self.waiters:
                looking = list(self.waiters)
                wanted = {w.run_id for w in looking if not w.once}
                ids = {w.run_id for w in looking}
                try:
                    seen: _Seen | Exception = await self._client.off_loop.call(
                        self._look, ids, wanted
                    )
                except Exception as exc:  # the store's error is each waiter's, as wait's
                    seen = exc
                now = time.monotonic()
                woken = 0
                for waiter in looking:
                    woken += _settle_waiter(waiter, seen, now)
                    if woken == SETTLE_AT_ONCE:
                        woken = 0
                        await asyncio.sleep(0)  # let those woken so far have a turn
                if self.waiters:
                    await self._sleep()
        finally:
            self._task = None
            self._forget(self)
            for waiter in list(self.waiters):  # the loop is going away: so are they
                waiter.future.cancel()

    def _look(self, ids: set[str], wanted: set[str]) -> _Seen:
        """On a pool thread: one read of every run waited on, and the result of each
        succeeded one in ``wanted`` (a large one is a blob: a second read)."""
        runtime = self._client.runtime
        seen: _Seen = {}
        for run_id, end in runtime.queries.run_ends(sorted(ids)).items():
            value, error = None, None
            if end.status == RunStatus.SUCCEEDED and run_id in wanted:
                try:
                    value = runtime.payloads.load(end.result)
                except Exception as exc:
                    error = exc
            seen[run_id] = (end.status, end.error, value, error)
        return seen

    async def _sleep(self) -> None:
        """Until the soonest waiter's next read or deadline, or a newcomer."""
        soonest = min(w.due if w.deadline is None else min(w.due, w.deadline) for w in self.waiters)
        pause = soonest - time.monotonic()
        if pause <= 0:
            return
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait([self._wake], timeout=pause)
        finally:
            self._wake = None


def _settle_waiter(waiter: _Waiter, seen: _Seen | Exception, now: float) -> bool:
    """What ``RunHandle._ended`` decides, from the shared read: the status (``once``),
    the result, ``RunFailed``, ``UnknownRun``, ``WaitTimeout`` past the deadline, or
    another read later (False)."""
    future = waiter.future
    if future.done():
        return False
    if isinstance(seen, Exception):
        future.set_exception(seen)
        return True
    if waiter.run_id not in seen:
        future.set_exception(UnknownRun(f"unknown run id {waiter.run_id!r}"))
        return True
    status, error, value, load_error = seen[waiter.run_id]
    if waiter.once:
        future.set_result(status.value)
        return True

    def loaded() -> Any:  # read on the pool thread by ``_look``
        if load_error is not None:
            raise load_error
        return value

    try:
        ended, result = verdict(
            waiter.run_id, status, error, loaded, waiter.deadline, waiter.timeout, now
        )
    except Exception as exc:
        future.set_exception(exc)
        return True
    if ended:
        future.set_result(result)
        return True
    waiter.due = now + waiter.delay
    waiter.delay = slower(waiter.delay)
    return False


class Waiters:
    """A ``Fleet``'s ``astatus`` and ``aresult`` calls: one ``_Poller`` per event loop."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._pollers: dict[asyncio.AbstractEventLoop, _Poller] = {}

    async def status(self, run_id: str) -> str:
        """``RunHandle.status``, read with the other waiters of this loop."""
        future = asyncio.get_running_loop().create_future()
        return str(await self._wait(_Waiter(run_id, future, once=True)))

    async def result(self, run_id: str, timeout: float | None, poll: float) -> Any:
        """``RunHandle.wait``: its value, ``RunFailed``, ``UnknownRun`` or, after a read
        at or past ``timeout`` seconds, ``WaitTimeout``."""
        if poll <= 0:
            raise ValueError(f"poll must be above 0 seconds, not {poll}")
        future = asyncio.get_running_loop().create_future()
        deadline = None if timeout is None else time.monotonic() + timeout
        return await self._wait(_Waiter(run_id, future, False, deadline, timeout, poll))

    async def _wait(self, waiter: _Waiter) -> Any:
        loop = asyncio.get_running_loop()
        with self._lock:
            poller = self._pollers.get(loop)
            if poller is None:
                poller = self._pollers[loop] = _Poller(self._client, self._forget)
        poller.add(waiter)
        return await waiter.future

    def _forget(self, poller: _Poller) -> None:
        with self._lock:
            for loop, known in list(self._pollers.items()):
                if known is poller:
                    del self._pollers[loop]
