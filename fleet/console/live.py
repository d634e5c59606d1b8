"""Live regions: server-sent events fed by one shared watcher per thing watched.

The rule: the store is asked about a run (or a filtered run list) at most once per
``interval`` however many browsers watch it. A ``Watcher`` per key (a run id, a set
of filters) asks for its fingerprint (one small query: ``Browse.run_fingerprint`` /
``runs_fingerprint``) once per interval while anyone subscribes; only when the
fingerprint changed does it render the region once, and format it once as an event,
and every subscriber's stream sends that same event (htmx's sse extension swaps it
in). A stream opened on a run whose watcher runs asks the store nothing (the run
exists: its watcher says so); streams arriving together for a run nobody watches
yet share one check that it exists. The last subscriber to leave stops the
watcher. A stream ends after ``stream_seconds`` (EventSource reconnects on its
own), so no connection is held forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

if TYPE_CHECKING:
    pass

log = logging.getLogger("fleet.console")

EVENT = "update"
KEEPALIVE = 15.0


class Watcher:
    """One key's poller: the last fingerprint, the HTML rendered for it and that HTML
    as an event (``frame``), its version."""

    def __init__(
        self, fingerprint: Callable[[], Any], render: Callable[[], str], interval: float
    ) -> None:
        self.fingerprint = fingerprint
        self.render = render
        self.interval = interval
        self.subscribers = 0
        self.version = 0
        self.html = ""
        self.frame = KEEP_ALIVE_FRAME
        self._last: Any = object()
        self._changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            try:
                mark = await run_in_threadpool(self.fingerprint)
                if mark != self._last:
                    self.html, self.frame = await run_in_threadpool(self._render)
                    self._last = mark
                    self.version += 1
                    changed, self._changed = self._changed, asyncio.Event()
                    changed.set()
            except Exception:  # the store is away: the page keeps what it shows
                log.warning("console: a live region could not be read", exc_info=True)
            await asyncio.sleep(self.interval)

    def _render(self) -> tuple[str, str]:
        html = self.render()
        return html, sse(html)

    async def changed(self, timeout: float) -> None:
        """Return once a new version is out, or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


class Hub:
    """The watchers of one console app, by key."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.watchers: dict[Hashable, Watcher] = {}
        self._checks: dict[Hashable, asyncio.Future[Any]] = {}

    async def admit(self, key: Hashable, check: Callable[[], Any]) -> bool:
        """Whether ``key``'s thing exists: True at once while its watcher runs, else
        ``check()`` (in a thread), one call shared by the streams arriving until its
        watcher starts (a yes is kept till then; a no or an error is not kept)."""
        if key in self.watchers:
            return True
        pending = self._checks.get(key)
        if pending is None:
            pending = self._checks[key] = asyncio.ensure_future(run_in_threadpool(check))

            def forget_a_no(done: asyncio.Future[Any]) -> None:
                if done.cancelled() or done.exception() is not None or not done.result():
                    self._checks.pop(key, None)

            pending.add_done_callback(forget_a_no)
        return bool(await asyncio.shield(pending))

    async def stream(
        self,
        key: Hashable,
        fingerprint: Callable[[], Any],
        render: Callable[[], str],
        seconds: float,
    ) -> AsyncIterator[str]:
        """The region as an event each time it changes (the current one first), for
        ``seconds``; a keep-alive comment now and then while nothing changes. Each
        version is formatted once, by the watcher, for every subscriber."""
        watcher = self.watchers.get(key)
        if watcher is None:
            watcher = self.watchers[key] = Watcher(fingerprint, render, self.interval)
            self._checks.pop(key, None)  # its watcher answers from now on
            watcher.task = asyncio.create_task(watcher.run())
        watcher.subscribers += 1
        seen = 0
        end = time.monotonic() + seconds
        try:
            while (left := end - time.monotonic()) > 0:
                if watcher.version > seen:
                    seen = watcher.version
                    yield watcher.frame
                    continue
                await watcher.changed(min(left, KEEPALIVE))
                if watcher.version == seen and end - time.monotonic() > 0:
                    yield KEEP_ALIVE_FRAME
        finally:
            watcher.subscribers -= 1
            if watcher.subscribers == 0:
                self.watchers.pop(key, None)
                if watcher.task is not None:
                    watcher.task.cancel()


def sse(html: str) -> str:
    """One event carrying ``html``; an empty one is a comment (a keep-alive)."""
    if not html:
        return ": keep-alive\n\n"
    lines = html.splitlines() or [""]
    return f"event: {EVENT}\n" + "".join(f"data: {line}\n" for line in lines) + "\n"


KEEP_ALIVE_FRAME = sse("")


def stream_response(frames: AsyncIterator[str]) -> Response:
    """The response that streams ``frames`` (server-sent events) to the browser."""
    return StreamingResponse(
        frames,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
