"""Async attempts off their slots (``fleet/worker/strands.py``): a greenlet on a strand
parks while its coroutine awaits and the strand's one thread runs the others; room is
bounded and handed back however an attempt ends; the sender's context goes along; a
greenlet whose loop died is woken with a one-line error; a shutdown drains them. A
fake ledger; no services."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from fleet.store.ledger import Lease
from fleet.worker import process, strands
from fleet.worker.aio import EventLoop, Runner
from fleet.worker.heartbeat import Heartbeat
from fleet.worker.strands import Strands
from tests.harness import poll

_PROC = process.current()


class _Renewing:
    def heartbeat(self, run_id: str, step_id: str, epoch: int, lease_seconds: float) -> bool:
        return True


def _heartbeat(step_id: str) -> Heartbeat:
    rt: Any = SimpleNamespace(ledger=_Renewing(), settings=SimpleNamespace(lease_seconds=60.0))
    return Heartbeat(rt, Lease("run", step_id, 1, 1, "s", "{}", False), _PROC.beater)


def _attempt(loop: EventLoop, fn: Callable[..., Any], *args: Any) -> Any:
    """What an attempt does with its body: through the Runner, under a heartbeat."""
    with _heartbeat("s#1") as hb:
        return Runner(loop, hb, "s")(fn, *args)


@pytest.mark.parametrize(
    ("where", "thread"), [("strand", "fleet-strand-0"), ("loop", "fleet-asyncio")]
)
def test_one_thread_awaits_many_coroutines_at_once(where: str, thread: str) -> None:
    """On one strand thread, or on the loop's own thread (fleet/worker/on_loop.py)."""
    pool = Strands()
    loop = EventLoop()
    pool.configure(threads=1, capacity=50, loop=loop.current() if where == "loop" else None)
    gate = threading.Event()
    awaiting = 0
    most = 0
    threads: set[str] = set()
    results: list[int] = []

    async def body(i: int) -> int:
        nonlocal awaiting, most
        awaiting += 1  # on the loop's one thread: no lock needed
        most = max(most, awaiting)
        while not gate.is_set():
            await asyncio.sleep(0.01)
        awaiting -= 1
        return i * i

    def attempt(i: int) -> None:
        threads.add(threading.current_thread().name)
        assert strands.current() is not None, "a greenlet off its slot knows where it runs"
        results.append(_attempt(loop, body, i))

    for i in range(20):
        assert pool.hand(lambda i=i: attempt(i))
    poll(lambda: most == 20, 10, "all twenty awaiting at once")
    assert pool.held() == 20
    gate.set()
    assert pool.drain(10), "every attempt ended"
    assert sorted(results) == [i * i for i in range(20)]
    assert threads == {thread}, "twenty attempts, one thread"
    assert pool.held() == 0


def test_past_its_capacity_an_attempt_stays_on_its_slot() -> None:
    pool = Strands()
    pool.configure(threads=2, capacity=2)
    release = threading.Event()
    blocked = [pool.hand(release.wait) for _ in range(3)]
    assert blocked == [True, True, False], "the third is run by its caller"
    release.set()
    assert pool.drain(10)
    assert pool.hand(lambda: None), "room given back"
    assert pool.drain(10)


def test_no_capacity_means_no_strands() -> None:
    pool = Strands()
    pool.configure(threads=4, capacity=0)
    assert not pool.on and not pool.hand(lambda: None)


def test_room_is_given_back_when_an_attempt_raises() -> None:
    pool = Strands()
    pool.configure(threads=1, capacity=1)

    def boom() -> None:
        raise RuntimeError("outside any step")

    assert pool.hand(boom)
    assert pool.drain(10)
    ran = threading.Event()
    assert pool.hand(ran.set), "the strand still serves"
    assert ran.wait(10)


def test_the_sender_s_context_goes_with_the_attempt() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="unset")
    pool = Strands()
    pool.configure(threads=1, capacity=4)
    seen: list[str] = []
    var.set("the slot's")
    assert pool.hand(lambda: seen.append(var.get()))
    assert pool.drain(10)
    assert seen == ["the slot's"]


def test_a_parked_attempt_whose_loop_died_fails_in_one_line() -> None:
    pool = Strands()
    pool.configure(threads=1, capacity=1)
    loop = EventLoop()
    errors: list[str] = []
    began = threading.Event()

    async def forever() -> None:
        began.set()
        await asyncio.Event().wait()

    def attempt() -> None:
        try:
            _attempt(loop, forever)
        except RuntimeError as exc:
            errors.append(str(exc))

    assert pool.hand(attempt)
    assert began.wait(10), "the coroutine to start, its greenlet parked"
    the_loop, thread = loop.current()
    the_loop.call_soon_threadsafe(the_loop.stop)  # its thread ends; the coroutine never will
    thread.join(10)
    assert pool.drain(10), "woken by the strand's look at its loop"
    assert errors == ["step 's': the worker's event loop stopped"]


def test_drain_says_when_attempts_outlast_it() -> None:
    pool = Strands()
    pool.configure(threads=1, capacity=1)
    release = threading.Event()
    assert pool.hand(release.wait)
    assert not pool.drain(0.2)
    release.set()
    assert pool.drain(10)


def test_a_slot_is_not_a_strand() -> None:
    assert strands.current() is None
    outcome: list[bool] = []
    t = threading.Thread(target=lambda: outcome.append(strands.current() is None))
    t.start()
    t.join(10)
    assert outcome == [True]


@pytest.mark.parametrize("capacity", [1, 3])
def test_held_never_passes_capacity(capacity: int) -> None:
    pool = Strands()
    pool.configure(threads=2, capacity=capacity)
    release = threading.Event()
    taken = sum(pool.hand(release.wait) for _ in range(10))
    assert taken == capacity and pool.held() == capacity
    release.set()
    assert pool.drain(10)


def test_the_settings_are_whole_numbers_and_awaiting_may_be_zero() -> None:
    from fleet import BadInput, Settings

    assert Settings.from_env({}).async_awaiting == 1000
    assert Settings.from_env({"FLEET_ASYNC_AWAITING": "0"}).async_awaiting == 0
    assert Settings.from_env({}).async_strands == 8
    assert Settings.from_env({"FLEET_ASYNC_STRANDS": "3"}).async_strands == 3
    with pytest.raises(BadInput, match=r"FLEET_ASYNC_AWAITING='-1' must be a whole number of 0"):
        Settings.from_env({"FLEET_ASYNC_AWAITING": "-1"})
    with pytest.raises(BadInput, match=r"FLEET_ASYNC_STRANDS='0' must be a whole number of 1"):
        Settings.from_env({"FLEET_ASYNC_STRANDS": "0"})
    assert Settings.from_env({}).async_on_loop is True
    assert Settings.from_env({"FLEET_ASYNC_ON_LOOP": "0"}).async_on_loop is False
    assert Settings.from_env({"FLEET_ASYNC_ON_LOOP": " Yes "}).async_on_loop is True
    with pytest.raises(BadInput, match=r"FLEET_ASYNC_ON_LOOP='maybe' must be 1 or 0"):
        Settings.from_env({"FLEET_ASYNC_ON_LOOP": "maybe"})
