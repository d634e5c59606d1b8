"""The event loop's watchdog: one thread per process that sees the loop held.

Every ``async def`` step of a process awaits on its one event loop (``aio.py``): a step
that blocks it (``time.sleep``, a sync HTTP call, a long computation) stalls all the
others, and nothing in asyncio says so outside its debug mode. Here a thread sends the
loop a beat (a plain callback) every quarter of the threshold (``FLEET_LOOP_WATCHDOG``,
1 s by default); a beat that has not run within the threshold means the loop is held,
and one warning line names what holds it: the step whose coroutine is running
(``asyncio.current_task``: each step's task is named after it), else the steps awaiting
on the loop. One line per stall: the next is logged only after the loop has answered.
A block longer than 1.25 times the threshold is always seen; a shorter one may be.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Hashable

log = logging.getLogger("fleet.attempt")

# How many awaiting steps a stall's line names at most.
_NAMED = 5


class Awaiting:
    """The steps whose coroutines are on the loop, by key: what a stall's line names
    when no step's own coroutine holds the loop. Shared with the watchdog's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[Hashable, str] = {}

    def add(self, key: Hashable, name: str) -> None:
        with self._lock:
            self._names[key] = name

    def remove(self, key: Hashable) -> None:
        with self._lock:
            self._names.pop(key, None)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._names.values())


class Watchdog:
    """Watches ``loop`` (run by ``thread``) until either ends."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        threshold: float,
        awaiting: Awaiting,
    ) -> None:
        self._loop = loop
        self._loop_thread = thread
        self._threshold = threshold
        self._awaiting = awaiting
        self._thread = threading.Thread(target=self._serve, name="fleet-loop-watchdog", daemon=True)
        self._thread.start()

    def _alive(self) -> bool:
        return self._loop_thread.is_alive() and not self._loop.is_closed()

    def _serve(self) -> None:
        beat = threading.Event()
        while self._alive():
            beat.clear()
            try:
                self._loop.call_soon_threadsafe(beat.set)
            except RuntimeError:  # the loop was closed meanwhile
                return
            if not beat.wait(self._threshold):
                self._held()
                while not beat.wait(1.0):  # one line per stall: until the loop answers
                    if not self._alive():
                        return
            time.sleep(self._threshold / 4)

    def _held(self) -> None:
        task = asyncio.current_task(self._loop)
        name = task.get_name() if task is not None else ""
        if name.startswith("step "):
            log.warning(
                "event loop held over %.1fs by %s: an `async def` step must not block "
                "(time.sleep, sync I/O, long computation); every async step of this "
                "process waits meanwhile",
                self._threshold,
                name,
            )
            return
        names = self._awaiting.names()
        shown = ", ".join(names[:_NAMED])
        if len(names) > _NAMED:
            shown += f" and {len(names) - _NAMED} more"
        log.warning(
            "event loop held over %.1fs, not by a step's own coroutine (%s); steps awaiting "
            "on it: %s",
            self._threshold,
            f"task {name}" if name else "a callback",
            shown or "none",
        )
