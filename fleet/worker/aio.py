"""The worker process's event loop, where ``async def`` steps (and reconcile hooks) run.

One loop per process, in its own daemon thread, created on first use and again in a
forked child (Celery's prefork pool: threads do not survive fork). Every slot of the
process submits to it, so a client created once (``httpx.AsyncClient``, ``AsyncOpenAI``)
is reused by every step the process runs. The slot's thread submits the coroutine and
waits for its outcome; everything else an attempt does (lease, effect gate, commit)
stays on that thread, as for a sync step. On a threads-pool worker the attempt has
usually left its slot for a greenlet on a strand (``fleet/worker/strands.py``): that
greenlet parks instead, and its strand's thread runs others while the coroutine
awaits. Sync steps never run on the loop, so none can block it.

When a renewal finds the lease lost (the run cancelled, the step taken over), the
coroutine's task is cancelled at once (``Heartbeat.when_lost``) and the attempt ends as
a sync step that lost its lease does (``LeaseLost``: its write is fenced).

Not on a gevent pool: under its monkey-patching the loop's thread, locks and sockets
would be greenlets' and the loop would stall the hub, so an async step there fails at
once with one line saying so (run such a worker with ``--pool threads`` or prefork).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from fleet.errors import NonRetryable
from fleet.registry import is_async
from fleet.worker import strands
from fleet.worker.context import LeaseLost
from fleet.worker.heartbeat import Heartbeat
from fleet.worker.on_loop import OnLoop
from fleet.worker.runtime import under_gevent
from fleet.worker.watchdog import Awaiting, Watchdog

log = logging.getLogger("fleet.attempt")

# How often a waiting slot checks that the loop's thread is still alive.
_ALIVE_CHECK = 1.0
# How long a coroutine cancelled because its lease was lost has to end before its
# attempt gives it up (logged) and gives back its slot.
CANCEL_GRACE = 5.0


class EventLoop:
    """The process's one event loop and its thread, (re)created on first use in each
    process; ``run`` waits on the calling thread for one coroutine's outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._threshold = 0.0  # the watchdog's (``watch``); 0: none
        self.awaiting = Awaiting()  # the steps whose coroutines are on the loop

    def watch(self, threshold: float) -> None:
        """Have a watchdog log a line whenever the loop is held over ``threshold``
        seconds (fleet/worker/watchdog.py), from the next loop made (each process
        makes its own); the smallest asked for wins. 0: asks for none."""
        with self._lock:
            if threshold > 0 and (not self._threshold or threshold < self._threshold):
                self._threshold = threshold

    def current(self) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
        """This process's loop and its thread, started if this process has none yet."""
        with self._lock:
            alive = self._thread is not None and self._thread.is_alive()
            if self._loop is None or self._pid != os.getpid() or not alive:
                # A forked child's copy is left alone: it was running in a thread that
                # is not in this process, so it cannot even be closed.
                self._pid = os.getpid()
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=_serve, args=(self._loop,), name="fleet-asyncio", daemon=True
                )
                self._thread.start()
                self.awaiting = Awaiting()  # a forked child's: none of the parent's
                if self._threshold:
                    Watchdog(self._loop, self._thread, self._threshold, self.awaiting)
            assert self._thread is not None
            return self._loop, self._thread

    def run(self, coro: Coroutine[Any, Any, Any], hb: Heartbeat, what: str) -> Any:
        """Run ``coro`` on the loop to its end and return what it returned or raise what
        it raised; ``LeaseLost`` if ``hb``'s lease was lost and its task cancelled."""
        loop, thread = self.current()
        # The slot's context (its log context, the redactor of the secrets it reveals)
        # goes with the coroutine, named here rather than left to where the task is made.
        lease = hb.lease
        name = f"step {lease.step_id} of run {lease.run_id}"  # its task's: what logs show
        call = _Call(coro, contextvars.copy_context(), name, self.awaiting)
        strand = strands.current()
        if isinstance(strand, OnLoop):
            return _run_on_loop(strand, call, hb, what)
        if strand is not None:  # a greenlet on a strand parks; its thread runs others
            call.wake = strand.waker(thread)
        loop.call_soon_threadsafe(call.start, loop)
        # After start, on the same loop: a cancel always finds the task made.
        hb.when_lost(lambda: loop.call_soon_threadsafe(call.cancel))
        if strand is not None:
            strand.sleep()
            if not call.done.is_set():  # woken by its loop's death (``Strand``)
                raise RuntimeError(f"{what}: the worker's event loop stopped")
        while not call.done.wait(_ALIVE_CHECK):
            if not thread.is_alive():
                raise RuntimeError(f"{what}: the worker's event loop stopped")
        return call.outcome(hb, what)


def _run_on_loop(strand: OnLoop, call: _Call, hb: Heartbeat, what: str) -> Any:
    """On the loop's own thread (fleet/worker/on_loop.py): the task is made here and
    its end switches back here; meanwhile the attempt holds no store token."""
    loop = strand.loop
    call.wake = strand.waker(strand.thread)
    call.start(loop)
    hb.when_lost(lambda: loop.call_soon_threadsafe(call.cancel))
    strand.release()
    if not call.done.is_set():  # set already only if the task could not be made
        strand.sleep()
    strand.acquire()
    return call.outcome(hb, what)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


class _Call:
    """One coroutine on the loop: its task, and its outcome for the waiting slot.
    ``start`` and ``cancel`` run on the loop's thread, in the order they were sent."""

    def __init__(
        self,
        coro: Coroutine[Any, Any, Any],
        context: contextvars.Context,
        name: str,
        awaiting: Awaiting,
    ) -> None:
        self.coro = coro
        self.context = context
        self.name = name
        self.awaiting = awaiting
        self.done = threading.Event()
        self.task: asyncio.Task[Any] | None = None
        self.lost = False
        self.swallowed = False  # it went on after fleet cancelled it (logged)
        self.value: Any = None
        self.error: BaseException | None = None
        # Called once ``done`` is set (from the loop's thread): wakes a parked greenlet.
        self.wake: Callable[[], None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.task = loop.create_task(
                _contained(self.coro), name=self.name, context=self.context
            )
        except BaseException as exc:  # the slot must not wait for a task never made
            self.coro.close()
            self.error = exc
            self._set_done()
            return
        self.awaiting.add(self, self.name)
        self.task.add_done_callback(self._finished)

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.lost = True
            self.task.cancel()
            self.task.get_loop().call_later(CANCEL_GRACE, self._unowned)

    def _unowned(self) -> None:
        """Its lease lost, the coroutine did not end when cancelled: it swallowed the
        CancelledError (or its clean-up still awaits). It is left running on the loop,
        owned by no attempt; its slot is given back (the attempt ends as lost)."""
        if self.done.is_set():
            return
        self.swallowed = True
        log.warning(
            "%s did not end within %gs of being cancelled (its lease lost): it swallowed "
            "the CancelledError; its coroutine is left running on the loop and its slot "
            "is given back",
            self.name,
            CANCEL_GRACE,
        )
        self.awaiting.remove(self)
        self._set_done()

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self.coro.close()  # a no-op once it ran; cancelled before it began: no warning
        self.awaiting.remove(self)
        if self.done.is_set():  # ended after it was given up (``_unowned``)
            return
        if task.cancelled():
            self.error = asyncio.CancelledError()
        elif (exc := task.exception()) is not None:
            self.error = exc
        else:
            self.value = task.result()
        if self.lost and not isinstance(self.error, asyncio.CancelledError):
            self.swallowed = True
            ended = "returned" if self.error is None else f"raised {type(self.error).__name__}"
            log.warning(
                "%s swallowed the CancelledError fleet sent when its lease was lost: it %s "
                "instead (its write is fenced)",
                self.name,
                ended,
            )
        self._set_done()

    def _set_done(self) -> None:
        self.done.set()
        if self.wake is not None:
            self.wake()

    def outcome(self, hb: Heartbeat, what: str) -> Any:
        if self.lost:  # however the step let the cancel out, or did not
            lease = hb.lease
            if not self.swallowed:  # else one line said so already
                log.warning(
                    "step %s of run %s lost its lease while awaiting: its coroutine was cancelled",
                    lease.step_id,
                    lease.run_id,
                )
            raise LeaseLost(
                f"step {lease.step_id} of run {lease.run_id} lost its lease (epoch "
                f"{lease.epoch}) while awaiting: its coroutine was cancelled"
            )
        if isinstance(self.error, asyncio.CancelledError):
            # Cancelled by the step's own code, not by fleet: an ordinary failure.
            raise RuntimeError(f"{what}: its coroutine was cancelled")
        if self.error is not None:
            raise self.error
        return self.value


async def _contained(coro: Coroutine[Any, Any, Any]) -> Any:
    """Await the step's coroutine. KeyboardInterrupt and SystemExit escape a task into
    the loop and would stop it for every slot: here they are the step's failure."""
    try:
        return await coro
    except (KeyboardInterrupt, SystemExit) as exc:
        raise RuntimeError(f"the step raised {type(exc).__name__}") from exc


class Runner:
    """How one attempt calls the user's functions (its body, its reconcile hook): an
    ``async def`` on the process's loop while this thread waits, a sync one here. Each
    is given the step's context first, as the step is."""

    def __init__(self, loop: EventLoop, hb: Heartbeat, step: str) -> None:
        self._loop = loop
        self._hb = hb
        self._step = step

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if is_async(fn):
            if under_gevent():
                raise NonRetryable(
                    f"step {self._step!r} is `async def`, which a gevent pool cannot run: "
                    "run its worker with --pool threads or prefork"
                )
            return self._loop.run(fn(*args, **kwargs), self._hb, f"step {self._step!r}")
        # No sync user code on the loop's thread: there it runs on a thread of its own.
        out = strands.off_the_loop(partial(fn, *args, **kwargs))
        if inspect.isawaitable(out):
            if inspect.iscoroutine(out):
                out.close()  # never awaited, on purpose: no warning about it
            raise NonRetryable(f"step {self._step!r} returned a coroutine: declare it `async def`")
        return out
