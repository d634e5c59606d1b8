"""The async client (``aenqueue``, ``asignal``, ``acancel``, ``arun``, ``astatus``,
``asteps``, ``aresult``) on both backends, with real workers where a run must move:
each does what its sync namesake does and raises what it raises, and none of them
blocks the caller's event loop."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fleet import BadInput, Fleet, RunFailed, RunHandle, UnknownRun, UnknownWorkflow, WaitTimeout
from fleet.aio_client import OFF_LOOP_THREADS
from fleet.states import RunStatus
from tests.harness import Backend, Cluster, client_for, starts


def _error(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("the sync call raised nothing")


def _aerror(call: Callable[[], Awaitable[Any]]) -> BaseException:
    async def go() -> BaseException:
        try:
            await call()
        except Exception as exc:
            return exc
        raise AssertionError("the async call raised nothing")

    return asyncio.run(go())


def _same_error(sync: Callable[[], Any], coro: Callable[[], Awaitable[Any]]) -> BaseException:
    """The sync call and its async namesake fail alike: same type, same one line."""
    expected, got = _error(sync), _aerror(coro)
    assert (type(got), str(got)) == (type(expected), str(expected))
    return got


def test_aenqueue_runs_the_workflow_and_aresult_returns_its_value(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")

    async def go() -> tuple[str, str, Any]:
        run = await client.aenqueue("chain", 3)
        first = await run.astatus()
        value = await run.aresult(timeout=60)
        return run.id, first, value

    run_id, first, value = asyncio.run(go())
    assert first in {s.value for s in RunStatus} and value == 5 == client.run(run_id).wait(
        timeout=0
    )
    assert asyncio.run(client.run(run_id).astatus()) == "succeeded"
    steps = asyncio.run(client.run(run_id).asteps())
    assert steps == client.run(run_id).steps() and [s.id for s in steps] == [
        "work#1",
        "work#2",
        "work#3",
    ]
    assert starts(backend, run_id) == {"work#1": 1, "work#2": 1, "work#3": 1}


def test_the_same_run_id_at_once_is_one_run_started_once(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    async def go() -> list[str]:
        handles = await asyncio.gather(
            *[client.aenqueue("chain", 2, run_id="order-42") for _ in range(20)]
        )
        return [h.id for h in handles]

    assert asyncio.run(go()) == ["order-42"] * 20
    assert [r.id for r in client.runtime.queries.runs(limit=100)] == ["order-42"]
    cluster.worker("w1")
    assert asyncio.run(client.run("order-42").aresult(timeout=60)) == 1
    assert starts(backend, "order-42") == {"work#1": 1, "work#2": 1}
    # Again once it has ended: still the same run, nothing started again.
    again = asyncio.run(client.aenqueue("chain", 2, run_id="order-42"))
    assert again.id == "order-42" and again.status() == "succeeded"
    assert starts(backend, "order-42") == {"work#1": 1, "work#2": 1}


def test_refusals_are_the_sync_ones(backend: Backend, client: Fleet) -> None:
    """Bad input fails in the caller's coroutine with the sync call's one line."""
    client.enqueue("chain", 1, run_id="taken")
    queued = client.run("taken")
    cases: list[tuple[Callable[[], Any], Callable[[], Awaitable[Any]], type[Exception]]] = [
        (lambda: client.enqueue("nope"), lambda: client.aenqueue("nope"), UnknownWorkflow),
        (lambda: client.enqueue("chain"), lambda: client.aenqueue("chain"), BadInput),
        (
            lambda: client.enqueue("chain", 1, run_id=""),
            lambda: client.aenqueue("chain", 1, run_id=""),
            BadInput,
        ),
        (
            lambda: client.enqueue("fan", 1, run_id="taken"),
            lambda: client.aenqueue("fan", 1, run_id="taken"),
            BadInput,
        ),
        (
            lambda: client.enqueue("chain", 1, budget={"tokens": -1}),
            lambda: client.aenqueue("chain", 1, budget={"tokens": -1}),
            BadInput,
        ),
        (lambda: client.run("ghost"), lambda: client.arun("ghost"), UnknownRun),
        (lambda: client.signal("ghost", "x"), lambda: client.asignal("ghost", "x"), UnknownRun),
        (
            lambda: client.signal("taken", "a#b"),
            lambda: client.asignal("taken", "a#b"),
            BadInput,
        ),
        (lambda: client.cancel("ghost"), lambda: client.acancel("ghost"), UnknownRun),
        (
            lambda: client.signal("taken", "x", object()),
            lambda: client.asignal("taken", "x", object()),
            BadInput,
        ),
        (lambda: queued.wait(timeout=0.2), lambda: queued.aresult(timeout=0.2), WaitTimeout),
    ]
    ghost = RunHandle(client, "ghost")  # a handle whose run is gone (or never was)
    cases += [
        (ghost.status, ghost.astatus, UnknownRun),
        (lambda: ghost.wait(timeout=1), lambda: ghost.aresult(timeout=1), UnknownRun),
    ]
    for sync, coro, kind in cases:
        assert isinstance(_same_error(sync, coro), kind)
    # None of them changed anything: the one run is still queued.
    assert [r.id for r in client.runtime.queries.runs(limit=100)] == ["taken"]
    assert queued.status() == "queued"


def test_asignal_resumes_a_waiting_run_and_acancel_ends_one(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")

    async def go() -> tuple[str, str]:
        approved, dropped = await client.aenqueue("approval"), await client.aenqueue("approval")
        for run in (approved, dropped):
            await _until(run.astatus, "waiting")
        await client.asignal(approved.id, "approval", {"approved": True})
        assert await approved.aresult(timeout=60) == {"decision": {"approved": True}}
        assert await client.acancel(dropped.id, reason="not needed") is True
        with pytest.raises(RunFailed) as failed:
            await dropped.aresult(timeout=60)
        assert failed.value.status == "cancelled"
        assert await dropped.astatus() == "cancelled"
        assert await client.acancel(approved.id) is False  # it had ended
        return approved.id, dropped.id

    approved, dropped = asyncio.run(go())
    assert starts(backend, approved) == {"work#1": 1, "work#2": 1}
    assert starts(backend, dropped) == {"work#1": 1}
    assert client.cancel(dropped) is False  # as the sync call says
    # Ended runs: the sync calls' refusals, word for word.
    error = _same_error(
        lambda: client.signal(approved, "approval"), lambda: client.asignal(approved, "approval")
    )
    assert "is succeeded: a signal can only go to a live run" in str(error)
    error = _same_error(
        lambda: client.run(dropped).wait(timeout=1),
        lambda: client.run(dropped).aresult(timeout=1),
    )
    assert isinstance(error, RunFailed) and "cancelled: not needed" in str(error)


def test_aresult_of_a_failed_run_raises_what_wait_raises(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("refusing")
    with pytest.raises(RunFailed):
        run.wait(timeout=60)
    error = _same_error(lambda: run.wait(timeout=1), lambda: run.aresult(timeout=1))
    assert isinstance(error, RunFailed) and error.status == "failed"
    assert "permission denied" in str(error)


async def _until(read: Callable[[], Awaitable[str]], want: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (got := await read()) != want:
        if time.monotonic() > deadline:
            pytest.fail(f"still {got} after {timeout}s, waiting for {want}")
        await asyncio.sleep(0.05)


class Ticker:
    """A coroutine that wants to run every ``period`` seconds: ``ticks`` are when it ran,
    ``lags`` how late it was each time. A blocked loop shows as no tick at all while it
    is blocked, then one late by as long."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.ticks: list[float] = []
        self.lags: list[float] = []
        self.stopped = False

    async def run(self) -> None:
        while not self.stopped:
            due = time.perf_counter() + self.period
            await asyncio.sleep(self.period)
            self.ticks.append(time.perf_counter())
            self.lags.append(max(0.0, self.ticks[-1] - due))


def test_fifty_aenqueues_at_once_leave_the_loop_free(
    backend: Backend, client: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """While 50 ``aenqueue`` run concurrently (each a store write and a broker send),
    a ticker on the same loop keeps ticking: the loop is not held by the calls."""
    done: list[float] = []

    async def enqueue(i: int) -> None:
        await client.aenqueue("chain", 1, run_id=f"r{i}")
        done.append(time.perf_counter())

    async def go() -> tuple[float, Ticker]:
        await client.aenqueue("chain", 1, run_id="warm-up")  # engine, pools, schema check
        ticker = Ticker()
        ticking = asyncio.create_task(ticker.run())
        await asyncio.sleep(0.05)
        ticker.ticks.clear()
        ticker.lags.clear()
        started = time.perf_counter()
        await asyncio.gather(*[enqueue(i) for i in range(50)])
        wall = time.perf_counter() - started
        ticker.stopped = True
        await ticking
        return wall, ticker

    wall, ticker = asyncio.run(go())
    runs = {r.id for r in client.runtime.queries.runs(limit=100)}
    assert runs == {"warm-up", *(f"r{i}" for i in range(50))}
    lags = sorted(ticker.lags)
    with capsys.disabled():  # the figures, for the record: lag bounds would be flaky
        print(
            f"\n[{backend.kind}] 50 aenqueue in {wall * 1000:.0f} ms; ticker: {len(lags)} ticks,"
            f" lag median {statistics.median(lags) * 1000:.1f} ms,"
            f" p99 {lags[int(len(lags) * 0.99) - 1] * 1000:.1f} ms, max {lags[-1] * 1000:.1f} ms"
        )
    # On the loop, the 50 calls would run back to back within one turn of it, and the
    # ticker would run only after the last. Off it, it runs while calls are in flight.
    during = [t for t in ticker.ticks if t < max(done)]
    assert len(during) >= 1, f"no tick while the calls ran ({wall * 1000:.0f} ms)"


def test_two_hundred_waiters_hold_no_thread_each(backend: Backend, client: Fleet) -> None:
    """``aresult`` waits on the loop: 200 waiters on runs that do not move (no worker)
    use at most the Fleet's few threads, and each times out as ``wait`` would, all in
    about a second (a thread per waiter on that pool would take 200 / 4 seconds)."""
    handles = [client.enqueue("chain", 1) for _ in range(4)]
    before = threading.active_count()
    peak = [before]

    async def go() -> list[BaseException | Any]:
        async def watch() -> None:
            while True:
                peak[0] = max(peak[0], threading.active_count())
                await asyncio.sleep(0.01)

        watching = asyncio.create_task(watch())
        waits = [h.aresult(timeout=1.0) for _ in range(50) for h in handles]
        done = await asyncio.gather(*waits, return_exceptions=True)
        watching.cancel()
        return done

    started = time.monotonic()
    done = asyncio.run(go())
    took = time.monotonic() - started
    assert len(done) == 200 and all(isinstance(e, WaitTimeout) for e in done), done[:3]
    assert peak[0] <= before + OFF_LOOP_THREADS
    assert took < 10, f"200 waits of 1 s took {took:.1f} s"


def test_concurrent_first_calls_on_a_new_store_create_it_once(backend: Backend) -> None:
    """The first calls of an async application come at once: the schema is checked
    (on SQLite: created) by one of them, the others wait for it."""
    from tests import flows

    fresh = flows.fleet.with_settings(backend.settings())
    if backend.kind == "postgres":
        client_for(backend).runtime.db.dispose()  # a server store is only migrated on purpose

    async def go() -> list[str]:
        handles = await asyncio.gather(*[fresh.aenqueue("chain", 1) for _ in range(20)])
        return [h.id for h in handles]

    try:
        ids = asyncio.run(go())
        assert len(set(ids)) == 20
        assert {r.id for r in fresh.runtime.queries.runs(limit=100)} == set(ids)
    finally:
        fresh.runtime.db.dispose()
