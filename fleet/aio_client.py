"""The async client: ``aenqueue``, ``asignal``, ``acancel`` and ``arun`` on ``Fleet`` (the
``AsyncClient`` mixin), ``astatus``, ``asteps`` and ``aresult`` on ``RunHandle``, for
applications that live on an event loop (FastAPI, Starlette, an agent on asyncio).

Each one is the sync method's work, run on a small pool of threads the ``Fleet`` owns
(``OffLoop``): the same arguments, the same semantics (an enqueue is idempotent by run
id), the same errors, raised in the caller's coroutine; the caller's loop never waits on
the store or the broker. Two of them are shared by the calls made at the same time:

- ``aenqueue`` calls that arrive together are inserted together (``Enqueues``): a
  thread takes every waiting call, checks each one's input alone (its refusal is its
  own), inserts all their runs in one statement of one transaction, then sends their
  wake-ups in one round to the broker. One commit and one round trip for N runs, and
  about a third of the interpreter's time per run (bench/RESULTS.md §9).
- ``aresult`` and ``astatus`` share one poller per event loop (``Waiters``): one read
  per round for every run waited on (``WHERE id IN (...)``), each waiter woken when its
  run ends, a cancelled waiter dropped at once. A waiter holds no thread: nothing ever
  blocks a pool thread on a wait, so one thread is enough for any number of them.

Why threads and not SQLAlchemy's asyncio extension over psycopg's async connections:
an enqueue is a store write *and* a broker send, and kombu is sync, so a thread is
needed either way; every write stays the one statement of the store's ledger
(invariant 2), not a second, async copy of it; and measured, the threads were as fast
and the loop freer: with the async engine the driver's Python runs on the caller's loop
itself (at 200 concurrent enqueues, a 5 ms ticker on the loop 22-39 ms late at p99).

Why two threads: the loop's lateness is the interpreter's lock, held by the pool's
threads while SQLAlchemy, psycopg and kombu run Python; each thread more is one more
holder the loop waits behind (§9: 13.6 ms late at p99 with one thread, 48.6 with four,
calls one by one). With batches, one thread made the endpoint's tail slower (a batch
waits for the lock at each of its round trips, and the reads wait behind it); two kept
the loop under 20 ms and the endpoint faster than four threads one call at a time.
Batches also pause (``GiveWay``) so that the loop is not kept waiting by them.

A coroutine cancelled while its call runs (a client that hung up) stops waiting, not the
call: an enqueue or a signal already on its thread still lands, as a sync call would
once its transaction had begun. Retrying it is safe where the sync call is (a run id).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fleet.aio_waiters import SETTLE_AT_ONCE, Waiters
from fleet.errors import BadInput
from fleet.handle import RunHandle
from fleet.store.engine import CommitUnknown
from fleet.worker.dispatch import CelerySender, Dispatcher

if TYPE_CHECKING:
    from fleet.registry import WorkflowDef
    from fleet.store.ledger import Ledger, NewChild
    from fleet.store.queries import Queries
    from fleet.worker.runtime import Runtime

T = TypeVar("T")

log = logging.getLogger("fleet.dispatch")

# Threads per Fleet for async callers (see the module's docstring). A burst of enqueues
# takes at most all of them, one batch at a time each; waiters take none between reads.
OFF_LOOP_THREADS = 2
ENQUEUE_BATCH = 100  # most runs one transaction of aenqueue inserts
# A pool thread running Python back to back holds the interpreter's lock, and the loop,
# which gives it up at each turn (its select), waits up to the switch interval (5 ms)
# to have it back, turn after turn. So a thread that has worked GIVE_WAY_AFTER seconds
# pauses GIVE_WAY_FOR seconds: the loop takes the lock while the thread sleeps.
GIVE_WAY_AFTER = 0.002
GIVE_WAY_FOR = 0.0002


class GiveWay:
    """One batch's pauses on its pool thread: called between two pieces of its work, it
    pauses if the batch has worked long since its last pause."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        self._clock = clock
        self._pause = pause
        self._since = clock()

    def __call__(self) -> None:
        if self._clock() - self._since >= GIVE_WAY_AFTER:
            self._pause(GIVE_WAY_FOR)
            self._since = self._clock()


class OffLoop:
    """A bounded pool of threads that runs the sync client's calls for async callers.

    Created on first use and again in a forked child (threads do not survive a fork)."""

    def __init__(self, threads: int = OFF_LOOP_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"OffLoop needs at least one thread, not {threads}")
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():
            with self._lock:
                if self._pool is None or self._pid != os.getpid():
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fleet-aio")
                    self._pid = os.getpid()
        return self._pool

    async def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on one of the threads, awaited; its exception raised
        here. The caller's context variables go with it (as ``asyncio.to_thread``)."""
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args, **kwargs)
        return await loop.run_in_executor(self._executor(), call)

    def submit(self, fn: Callable[[], None]) -> ThreadFuture[None]:
        """``fn()`` on one of the threads, not awaited (it settles its callers itself)."""
        return self._executor().submit(fn)

    def shutdown(self) -> None:
        """Let the threads go once their calls are done (a new call starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def create_run(run: NewChild, ledger: Ledger, queries: Queries) -> bool:
    """Insert ``run``: True if inserted (its wake-up is to be sent), False if the run
    was there already (enqueue is idempotent); ``BadInput`` if its id is another
    workflow's run. ``Fleet.enqueue``'s insert, and a call's of ``aenqueue`` alone."""
    if run.run_id in ledger.create_runs([run]):
        return True
    check_taken(run, queries)
    return False


def check_taken(run: NewChild, queries: Queries) -> None:
    """A run id found taken is the same run enqueued again, unless it is another
    workflow's run: ``BadInput``."""
    existing = queries.run(run.run_id)
    if existing is not None and existing.workflow != run.workflow:
        rid = run.run_id
        raise BadInput(f"run id {rid!r} already belongs to workflow {existing.workflow!r}")


def _settle_some(settled: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    """On the futures' loop: each its value or its error, unless its caller gave up;
    ``SETTLE_AT_ONCE`` of them per turn of the loop, so that a batch's callers, woken
    together, do not hold the loop for a whole batch's worth of their own work."""
    for future, value, error in settled[:SETTLE_AT_ONCE]:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    if len(settled) > SETTLE_AT_ONCE:
        asyncio.get_running_loop().call_soon(_settle_some, settled[SETTLE_AT_ONCE:])


@dataclass(eq=False)
class _Enqueue:
    """One ``aenqueue`` call waiting for the thread: its checks (``prepare``, run in the
    caller's context), and where its outcome goes."""

    prepare: Callable[[], NewChild]
    ctx: contextvars.Context
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[str]
    run: NewChild | None = None
    created: bool = False
    error: BaseException | None = None


class Enqueues:
    """A ``Fleet``'s ``aenqueue`` calls, inserted in batches: each of the pool's threads
    takes what waits when it is free (one batch when calls come in a burst)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._pending: list[_Enqueue] = []
        self._draining = 0  # threads inserting batches now, at most the pool's size
        self._pid = os.getpid()

    async def enqueue(self, prepare: Callable[[], NewChild]) -> str:
        """The run id ``prepare``'s run has once inserted (or found there) and woken."""
        loop = asyncio.get_running_loop()
        call = _Enqueue(prepare, contextvars.copy_context(), loop, loop.create_future())
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's threads are not here
                self._pending, self._draining, self._pid = [], 0, os.getpid()
            self._pending.append(call)
            start = self._draining < self._client.off_loop.threads
            self._draining += start
        if start:
            self._client.off_loop.submit(self._drain)
        return await call.future

    def _drain(self) -> None:
        """On a pool thread: one batch of the calls waiting, then this again behind what
        the pool was given meanwhile (a shared read, a signal), so that a stream of
        enqueues never holds a thread from the other calls; until no call waits (then
        a new call starts it)."""
        with self._lock:
            batch = self._pending[:ENQUEUE_BATCH]
            del self._pending[:ENQUEUE_BATCH]
            if not batch:
                self._draining -= 1
                return
        try:
            self._enqueue(batch)
        except BaseException as exc:  # a bug here must not leave its callers waiting
            for call in batch:
                call.error = call.error or exc
        self._settle(batch)
        self._client.off_loop.submit(self._drain)

    def _enqueue(self, batch: list[_Enqueue]) -> None:
        """``enqueue`` for each call of ``batch``, the runs inserted in one transaction."""
        todo: list[_Enqueue] = []
        give_way = GiveWay()
        for call in batch:
            if call.future.cancelled():  # gave up before its turn: as an unstarted call
                continue
            give_way()
            try:
                call.run = call.ctx.run(call.prepare)
                todo.append(call)
            except Exception as exc:
                call.error = exc
        # In id order, so two processes' batches lock the same new rows in the same order.
        todo.sort(key=lambda c: c.run.run_id if c.run else "")
        give_way()
        if not (len(todo) > 1 and self._insert_together(todo)):
            for call in todo:
                self._insert_alone(call)
        self._wake([call for call in todo if call.created], give_way)

    def _wake(self, new: list[_Enqueue], give_way: GiveWay) -> None:
        """Each new run's wake-up, as ``enqueue`` sends it; through Celery, all of them
        in one round to the broker (kombu's batch: one Redis pipeline), which also takes
        half the interpreter's time of one publish each. A failure to send is logged,
        never the caller's: the sweeper re-sends what was lost (as for ``enqueue``)."""
        dispatcher = self._client.runtime.dispatcher
        if type(dispatcher.sender) is not CelerySender or len(new) < 2:  # the test seam's
            for call in new:
                assert call.run is not None
                call.ctx.run(dispatcher.advance, call.run.run_id, call.run.queue)
            return
        celery = dispatcher.sender.celery
        try:
            with celery.producer_or_acquire() as producer, producer.batch():
                one_round = Dispatcher(CelerySender(celery, producer))
                for call in new:
                    assert call.run is not None
                    give_way()
                    call.ctx.run(one_round.advance, call.run.run_id, call.run.queue)
        except Exception as exc:  # the broker is down, the round was cut: the sweeper
            ids = [call.run.run_id for call in new if call.run]
            log.warning(
                "could not send the wake-ups of runs %s (%s); the sweeper will re-send them",
                ids,
                exc,
            )

    def _insert_together(self, todo: list[_Enqueue]) -> bool:
        """Every run in one statement and one transaction: False if it failed, and each
        call is to be tried on its own (so that one call's failure is never the others').
        A run id another workflow holds is that call's refusal alone; one id twice is one
        run, woken once; a commit whose outcome is unknown is every call's error, as it
        would be of each call alone."""
        runtime, claimed = self._client.runtime, set[str]()
        try:
            with runtime.db.transaction() as tx:
                inserted = runtime.ledger.within(tx).create_runs([c.run for c in todo if c.run])
                queries = runtime.queries.within(tx)
                for call in todo:
                    assert call.run is not None
                    rid = call.run.run_id
                    call.created = rid in inserted and rid not in claimed
                    claimed.add(rid)
                    if not call.created:
                        try:
                            check_taken(call.run, queries)
                        except BadInput as exc:
                            call.error = exc
        except CommitUnknown as exc:
            for call in todo:
                call.created, call.error = False, exc
        except Exception:
            for call in todo:
                call.created, call.error = False, None
            return False
        return True

    def _insert_alone(self, call: _Enqueue) -> None:
        """The sync ``enqueue``'s insert, in its own transaction."""
        runtime = self._client.runtime
        assert call.run is not None
        try:
            call.created = create_run(call.run, runtime.ledger, runtime.queries)
        except Exception as exc:
            call.error = exc

    @staticmethod
    def _settle(batch: list[_Enqueue]) -> None:
        """Each caller's outcome on its loop: one wake-up of each loop for the batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, BaseException | None]]] = {}
        for call in batch:
            run_id = call.run.run_id if call.run else None
            by_loop.setdefault(call.loop, []).append((call.future, run_id, call.error))
        for loop, settled in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(_settle_some, settled)


class AsyncClient:
    """``Fleet``'s async methods: each runs its sync namesake's work on ``self.off_loop``
    (``aenqueue`` batched by ``self.enqueues``)."""

    off_loop: OffLoop
    enqueues: Enqueues
    waiters: Waiters
    runtime: Runtime

    if TYPE_CHECKING:  # provided by Fleet

        def _new_run(
            self,
            workflow: WorkflowDef | str,
            args: tuple[Any, ...],
            kwargs: Mapping[str, Any],
            run_id: str | None,
            budget: Mapping[str, float] | None,
            tenant: str | None,
        ) -> NewChild: ...

        def run(self, run_id: str) -> RunHandle: ...

        def signal(
            self,
            run_id: str,
            name: str,
            payload: Any = None,
            *,
            wait_id: str | None = None,
            by: str | None = None,
            why: str | None = None,
        ) -> None: ...

        def cancel(
            self,
            run_id: str,
            reason: str = "cancelled",
            *,
            by: str | None = None,
            why: str | None = None,
        ) -> bool: ...

    async def aenqueue(
        self,
        workflow: WorkflowDef | str,
        *args: Any,
        run_id: str | None = None,
        budget: Mapping[str, float] | None = None,
        tenant: str | None = None,
        **kwargs: Any,
    ) -> RunHandle:
        """``enqueue``, awaited: the run is recorded and its wake-up sent off the loop.
        With ``run_id``, idempotent: the same id twice (even at once) is one run."""
        prepare = functools.partial(self._new_run, workflow, args, kwargs, run_id, budget, tenant)
        return RunHandle(self, await self.enqueues.enqueue(prepare))

    async def arun(self, run_id: str) -> RunHandle:
        """``run``, awaited: a handle for an existing run, or ``UnknownRun``."""
        return await self.off_loop.call(self.run, run_id)

    async def asignal(
        self,
        run_id: str,
        name: str,
        payload: Any = None,
        *,
        wait_id: str | None = None,
        by: str | None = None,
        why: str | None = None,
    ) -> None:
        """``signal``, awaited: ``payload`` to the run's ``wf.wait_for(name)`` (to the one
        open wait ``wait_id`` if given; audited with ``by``, ``why``)."""
        await self.off_loop.call(
            self.signal, run_id, name, payload, wait_id=wait_id, by=by, why=why
        )

    async def acancel(
        self,
        run_id: str,
        reason: str = "cancelled",
        *,
        by: str | None = None,
        why: str | None = None,
    ) -> bool:
        """``cancel``, awaited: False if the run had already ended (audited with ``by``,
        ``why``)."""
        return await self.off_loop.call(self.cancel, run_id, reason, by=by, why=why)
