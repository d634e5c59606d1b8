"""Attempts on the loop's own thread: on Postgres, the attempts of ``async def`` steps
that leave their slots go on as greenlets on the thread of the process's event loop,
not on strand threads (fleet/worker/strands.py).

Why: on strand threads every step crossed threads four times (the coroutine started on
the loop's thread, its end woken back on the strand's, a store round trip blocking
the strand while its other greenlets waited), and at 500 awaiting steps a fifth of
the worker's CPU went to switching threads and handing the interpreter lock between
them. Here an attempt starts its coroutine as a task of the loop it runs beside, is
switched back into by that task's end, and waits for each store round trip on the
loop too (``park_on_socket``: the socket watched by the loop, fleet/store/waits.py), so one
thread holds hundreds of attempts and keeps several transactions in flight.

The rules that keep it safe, besides those of strands:
- the loop's thread runs a greenlet only from a plain callback (never inside a task's
  step), and a greenlet gives the thread back only where it waits: on its coroutine,
  on a store round trip, on a token (below), or on a sync function run on a thread;
- at most ``tokens`` attempts here touch the store at once (each holds one token from
  its start to its end, but not while its coroutine awaits), and the worker keeps a
  store connection for each (``FLEET_ASYNC_STRANDS``): a greenlet never waits on the
  pool, which would block the thread the holders need to go on;
- no sync user code runs on the loop's thread: a sync reconcile hook runs on a thread
  of its own while its greenlet waits (``off_thread``);
- a store call made where no greenlet of this module waits (the workflow's own
  greenlet, a coroutine's ``ctx.record_usage``) blocks the loop for its round trip,
  as it did before: no switch happens there, so nothing can interleave with it.
SQLite keeps strand threads: its calls cannot wait on the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import greenlet

from fleet.store.waits import READABLE, WRITABLE

log = logging.getLogger("fleet.attempt")


class _Attempt(greenlet.greenlet):
    """An attempt's greenlet here: its store connections wait through ``park_on_socket``,
    and ``strands.current()`` finds where it runs (``runner``)."""

    park_on_socket: Callable[[int, bool, bool], int]
    runner: OnLoop


class OnLoop:
    """The greenlets of one loop's thread: new attempts arrive by ``spawn`` from any
    thread and run there, each until it waits (see the module's rules)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        tokens: int,
        done: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.thread = thread
        self._done = done
        self._hub: greenlet.greenlet | None = None
        self._free = tokens
        self._queued: deque[greenlet.greenlet] = deque()
        self._threads = ThreadPoolExecutor(thread_name_prefix="fleet-off-loop")

    # --- starting and ending --------------------------------------------------------

    def spawn(self, fn: Callable[[], object], context: contextvars.Context) -> None:
        """Run ``fn`` as a new greenlet on the loop's thread, in ``context``."""
        self.loop.call_soon_threadsafe(self._start, fn, context)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.loop.is_closed()

    def _start(self, fn: Callable[[], object], context: contextvars.Context) -> None:
        self._hub = greenlet.getcurrent()
        g = _Attempt(lambda: self._body(fn))
        g.gr_context = context
        g.park_on_socket = self.park_on_socket
        g.runner = self
        g.switch()

    def _body(self, fn: Callable[[], object]) -> None:
        try:
            self.acquire()
            try:
                fn()
            finally:
                self.release()
        except BaseException:  # one attempt's failure must not reach the loop
            log.exception("an attempt on the loop's thread failed outside its step")
        finally:
            self._done()

    def owns(self, g: greenlet.greenlet) -> bool:
        return isinstance(g, _Attempt) and self._hub is not None and g.parent is self._hub

    # --- waiting --------------------------------------------------------------------

    def sleep(self) -> Any:
        """Give the thread back to the loop until something switches here again."""
        assert self._hub is not None
        return self._hub.switch()

    def waker(self, _loop_thread: threading.Thread) -> Callable[[], None]:
        """What wakes the calling greenlet, called on the loop's thread (a task's end)."""
        g = greenlet.getcurrent()
        fired = False

        def wake() -> None:
            nonlocal fired
            if fired or greenlet.getcurrent() is g:  # done before it slept: no switch
                fired = True
                return
            fired = True
            g.switch()

        return wake

    def acquire(self) -> None:
        """Take a token (one of the connections kept for the attempts here), waiting
        behind the others if none is free."""
        if self._free > 0:
            self._free -= 1
            return
        self._queued.append(greenlet.getcurrent())
        self.sleep()  # the token is handed over by ``release``

    def release(self) -> None:
        if self._queued:
            self.loop.call_soon(self._queued.popleft().switch)
        else:
            self._free += 1

    def park_on_socket(self, fileno: int, reading: bool, writing: bool) -> int:
        """Park the calling greenlet until the loop sees the socket ready for what is
        asked (fleet/store/waits.py drives psycopg with it); what it is ready for."""
        g = greenlet.getcurrent()
        loop = self.loop
        fired = False

        def on(ready: int) -> None:
            nonlocal fired
            if not fired:  # both watched, both ready in one turn: the first one wakes it
                fired = True
                g.switch(ready)

        if reading:
            loop.add_reader(fileno, on, READABLE)
        if writing:
            loop.add_writer(fileno, on, WRITABLE)
        try:
            ready: int = self.sleep()
        finally:
            if reading:
                loop.remove_reader(fileno)
            if writing:
                loop.remove_writer(fileno)
        return ready

    def off_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run sync ``fn`` on a thread while the calling greenlet waits; its outcome."""
        context = contextvars.copy_context()
        future = self._threads.submit(context.run, fn, *args, **kwargs)
        wake = self.waker(self.thread)
        # Always woken later, from the loop: never before this greenlet sleeps.
        future.add_done_callback(lambda _f: self.loop.call_soon_threadsafe(wake))
        self.sleep()
        return future.result()
