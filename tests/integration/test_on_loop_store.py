"""On Postgres, attempts on the loop's own thread (``fleet/worker/on_loop.py``) wait for
their store round trips on the loop (``fleet/store/waits.py``): several transactions are
in flight at once from that one thread, and a coroutine on the loop goes on meanwhile.
Real Postgres; no worker."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from fleet import Fleet
from fleet.store import waits
from fleet.worker.aio import EventLoop
from fleet.worker.strands import Strands
from tests.harness import Backend

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


def test_round_trips_of_attempts_on_the_loop_overlap(backend: Backend, client: Fleet) -> None:
    loop = EventLoop()
    pool = Strands()
    pool.configure(threads=4, capacity=10, loop=loop.current())
    db = client.runtime.db
    spans: list[tuple[float, float, str]] = []
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    event_loop, _thread = loop.current()
    asyncio.run_coroutine_threadsafe(ticker(), event_loop)

    def attempt() -> None:
        started = time.monotonic()
        with db.begin() as conn:
            assert isinstance(conn.connection.driver_connection, waits.Connection)
            conn.exec_driver_sql("SELECT pg_sleep(0.5)")
        spans.append((started, time.monotonic(), threading.current_thread().name))

    for _ in range(4):
        assert pool.hand(attempt)
    before = ticks
    assert pool.drain(30)
    assert {name for _, _, name in spans} == {"fleet-asyncio"}, "all four on the loop's thread"
    took = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    assert took < 1.5, f"four 0.5 s round trips one after another would take 2 s: {took:.2f}"
    assert ticks - before >= 20, "the loop's coroutines went on while they waited"
