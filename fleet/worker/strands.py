"""Awaiting off the slot: on a threads-pool worker, an ``async def`` step's attempt
leaves the Celery slot that took its lease and goes on as a greenlet on one of a few
strand threads, so that a coroutine awaiting a model call holds no thread.

Why greenlets: an attempt is sequential code (its input, its effect gate, the body, the
commit with the replay, the next step's lease) that waits in one place, for its
coroutine (``EventLoop.run``). A greenlet parks there and its strand runs the others;
the code stays as a sync step's is, on a thread of its own, and 500 awaiting steps
cost 500 greenlets and a few threads instead of 500 threads contending for the
interpreter lock. Nothing is monkey-patched: a strand's sync work (a store round trip)
blocks that strand, so there are several; a greenlet parks only while its coroutine
runs on the loop, and it holds no store connection, transaction or lock then.

The rules that keep it safe:
- only an attempt whose body is ``async def`` leaves its slot, and a strand keeps a
  run's next step inline only if it is async too (a sync one is sent, and runs on a
  slot): no sync body ever blocks a strand (a sync reconcile hook of an async effect
  runs on its strand's thread, briefly blocking the strand's other greenlets);
- at most ``async_awaiting`` attempts are on the strands of a process; past that an
  async attempt stays on its slot and waits there, as it always did, so the slot's
  thread count still bounds what a full process takes, and nothing waits for room
  while holding a lease without its heartbeat;
- the lease was taken on the slot and the heartbeat starts with the body, as for any
  attempt; a process killed with attempts on its strands loses them as a killed slot
  would: the leases lapse and the sweeper sends the steps again;
- a warm shutdown waits for the strands' attempts (``drain``) within the same grace a
  slot's attempt has, after which the leases are released as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import greenlet

from fleet.worker.on_loop import OnLoop

log = logging.getLogger("fleet.attempt")

T = TypeVar("T")

# How often a strand checks that the loop its parked greenlets wait on is alive.
_ALIVE_CHECK = 1.0


class _Wake:
    """One park's wake-up: fired once, by the coroutine's end or by its loop's death."""

    __slots__ = ("_g", "_fired")

    def __init__(self, g: greenlet.greenlet) -> None:
        self._g = g
        self._fired = False

    def __call__(self) -> None:  # on the strand's thread, from its hub
        if not self._fired:
            self._fired = True
            self._g.switch()


class Strand:
    """One thread running greenlets: new attempts and wake-ups arrive in its inbox and
    run on its thread in turn, each until it ends or parks."""

    def __init__(self, name: str, done: Callable[[], None]) -> None:
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._done = done
        self._hub: greenlet.greenlet | None = None
        # Parked greenlets' wake-ups, with the loop thread each waits on.
        self._parked: dict[_Wake, threading.Thread] = {}
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def spawn(self, fn: Callable[[], object], context: contextvars.Context) -> None:
        """Run ``fn`` as a new greenlet here, in (a copy of) the sender's context."""
        self._inbox.put(lambda: self._start(fn, context))

    def _start(self, fn: Callable[[], object], context: contextvars.Context) -> None:
        g = greenlet.greenlet(lambda: self._body(fn))
        g.gr_context = context
        g.runner = self  # what ``current()`` answers in it
        g.switch()

    def _body(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException:  # one attempt's failure must not stop the strand
            log.exception("an attempt on strand %s failed outside its step", self._thread.name)
        finally:
            self._done()

    def waker(self, loop_thread: threading.Thread) -> Callable[[], None]:
        """For the calling greenlet, about to ``sleep`` until its coroutine on
        ``loop_thread`` ends: what that end calls (from any thread) to wake it."""
        wake = _Wake(greenlet.getcurrent())
        self._parked[wake] = loop_thread
        return lambda: self._inbox.put(wake)

    def sleep(self) -> None:
        """Park the calling greenlet until its waker is called (or its loop dies); the
        strand runs its other greenlets meanwhile."""
        assert self._hub is not None
        self._hub.switch()

    def owns(self, g: greenlet.greenlet) -> bool:
        return self._hub is not None and g.parent is self._hub

    def _serve(self) -> None:
        self._hub = greenlet.getcurrent()
        looked = time.monotonic()
        while True:
            try:
                job = self._inbox.get(timeout=_ALIVE_CHECK)
            except queue.Empty:
                job = None
            if job is not None:
                if isinstance(job, _Wake):
                    self._parked.pop(job, None)  # woken: no longer an orphan to look for
                job()
            # Once a second, busy or not: a strand kept busy by others' wake-ups must
            # still find the greenlets whose loop died.
            if time.monotonic() - looked >= _ALIVE_CHECK:
                looked = time.monotonic()
                self._wake_orphans()

    def _wake_orphans(self) -> None:
        """Wake the greenlets whose loop has died: each finds its coroutine not done."""
        for wake, thread in list(self._parked.items()):
            if not thread.is_alive():
                self._parked.pop(wake, None)
                wake()


def current() -> Strand | OnLoop | None:
    """The strand the calling greenlet runs on (the one that started it), or None on
    any other thread (a slot) or greenlet."""
    strand: Strand | OnLoop | None = getattr(greenlet.getcurrent(), "runner", None)
    if strand is None or not strand.owns(greenlet.getcurrent()):
        return None
    return strand


def off_the_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` here; on the loop's own thread (an attempt there, on a Postgres
    store), on a thread of its own while the calling greenlet waits: sync work that
    may block (user code, a broker that does not answer) never stalls the loop."""
    strand = current()
    if isinstance(strand, OnLoop):
        return strand.off_thread(fn, *args)
    return fn(*args)


class Strands:
    """A process's strands and how many attempts they hold (at most ``capacity``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._strands: list[Strand] = []
        self._on_loop: OnLoop | None = None
        self._capacity = 0
        self._held = 0
        self._next = 0

    def configure(
        self,
        threads: int,
        capacity: int,
        loop: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None,
    ) -> None:
        """Take attempts off their slots from now on: ``capacity`` at most, on
        ``threads`` strands (made now; 0 capacity: none leave their slot), or, given
        ``loop`` (the process's event loop and its thread: a Postgres store), on that
        loop's thread with ``threads`` store connections between them
        (fleet/worker/on_loop.py)."""
        with self._lock:
            self._capacity = capacity
            if capacity and loop is not None:
                self._on_loop = OnLoop(loop[0], loop[1], threads, self._release)
                return
            while capacity and len(self._strands) < threads:
                self._strands.append(Strand(f"fleet-strand-{len(self._strands)}", self._release))

    @property
    def on(self) -> bool:
        return self._capacity > 0 and (bool(self._strands) or self._on_loop is not None)

    def hand(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` on a strand if one has room (True); False: run it here."""
        with self._lock:
            if self._held >= self._capacity:
                return False
            if self._on_loop is not None and self._on_loop.alive:
                strand: Strand | OnLoop = self._on_loop
            elif self._strands:
                strand = self._strands[self._next % len(self._strands)]
                self._next += 1
            else:
                return False
            self._held += 1
        strand.spawn(fn, contextvars.copy_context())
        return True

    def held(self) -> int:
        with self._lock:
            return self._held

    def _release(self) -> None:
        with self._lock:
            self._held -= 1
            if self._held == 0:
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every attempt on the strands to end (a warm
        shutdown); whether they all did."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._held:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True
