"""Attempts on the loop's own thread (``fleet/worker/on_loop.py``; that many await at
once there is tests/unit/test_strands.py's): a socket wait parks only its own greenlet,
at most ``tokens`` of them hold the store at once, sync code runs on a thread of its
own (hooks, the limits' calls, every broker send), room is handed back and the sender's
context goes along, and an attempt left parked by a stopped loop gives its lease up.
Sockets and fakes; no services."""

from __future__ import annotations

import asyncio
import contextvars
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import greenlet
import pytest

from fleet.store import waits
from fleet.store.waits import READABLE, WRITABLE
from fleet.worker.aio import EventLoop
from fleet.worker.strands import Strands
from tests.harness import poll
from tests.unit.test_strands import _attempt


def _on_loop(tokens: int = 8, capacity: int = 50) -> tuple[Strands, EventLoop]:
    loop = EventLoop()
    pool = Strands()
    pool.configure(threads=tokens, capacity=capacity, loop=loop.current())
    return pool, loop


def _store_round_trip(sock: socket.socket) -> int:
    """A round trip's wait as an attempt's store connection makes it
    (fleet/store/waits.py): parked until the socket can be read."""
    ready = greenlet.getcurrent().park_on_socket(sock.fileno(), True, False)
    assert ready == READABLE
    return len(sock.recv(100))


def test_a_socket_wait_parks_only_its_own_greenlet() -> None:
    pool, _loop = _on_loop()
    waiting, peer = socket.socketpair()
    order: list[str] = []

    def slow() -> None:
        order.append("slow sent")
        order.append(f"slow got {_store_round_trip(waiting)}")

    def quick() -> None:
        order.append("quick ran")
        peer.send(b"abc")  # the answer the slow one waits for

    assert pool.hand(slow)
    poll(lambda: order == ["slow sent"], 10, "the slow one to wait")
    assert pool.hand(quick)
    assert pool.drain(10)
    assert order == ["slow sent", "quick ran", "slow got 3"], "the loop ran the other meanwhile"
    waiting.close()
    peer.close()


def test_at_most_tokens_attempts_hold_the_store_at_once() -> None:
    pool, _loop = _on_loop(tokens=2)
    pairs = [socket.socketpair() for _ in range(6)]
    holding = most = 0

    def attempt(sock: socket.socket) -> None:
        nonlocal holding, most
        holding += 1  # between its start and its end it holds a token
        most = max(most, holding)
        _store_round_trip(sock)
        holding -= 1

    for sock, _ in pairs:
        assert pool.hand(lambda sock=sock: attempt(sock))
    poll(lambda: holding == 2, 10, "two attempts in the store")
    time.sleep(0.2)
    assert holding == 2, "the others wait for a token, not for a connection"
    for _, peer in pairs:
        peer.send(b"x")
    assert pool.drain(10)
    assert most == 2
    for a, b in pairs:
        a.close()
        b.close()


def test_an_awaiting_attempt_holds_no_token() -> None:
    pool, loop = _on_loop(tokens=1)
    gate = threading.Event()
    awaiting = 0

    async def body() -> None:
        nonlocal awaiting
        awaiting += 1
        while not gate.is_set():
            await asyncio.sleep(0.01)

    for _ in range(5):
        assert pool.hand(lambda: _attempt(loop, body))
    poll(lambda: awaiting == 5, 10, "five awaiting on one token")
    gate.set()
    assert pool.drain(10)


def test_sync_code_runs_on_a_thread_of_its_own() -> None:
    pool, loop = _on_loop()
    seen: list[Any] = []

    def hook(x: int) -> int:
        seen.append(threading.current_thread().name)
        return x + 1

    def failing() -> None:
        raise ValueError("the hook's own error")

    def attempt() -> None:
        seen.append(_attempt(loop, hook, 41))
        with pytest.raises(ValueError, match="the hook's own error"):
            _attempt(loop, failing)
        seen.append("went on")

    assert pool.hand(attempt)
    assert pool.drain(10)
    assert seen[0].startswith("fleet-off-loop") and seen[1:] == [42, "went on"]


def test_room_is_given_back_and_the_sender_s_context_goes_along() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="unset")
    pool, _loop = _on_loop(capacity=1)
    seen: list[str] = []

    def boom() -> None:
        raise RuntimeError("outside any step")

    assert pool.hand(boom)
    assert pool.drain(10)
    var.set("the slot's")
    assert pool.hand(lambda: seen.append(var.get())), "room given back after a failure"
    assert pool.drain(10)
    assert seen == ["the slot's"]


def test_a_dead_loop_takes_no_more_attempts() -> None:
    pool, loop = _on_loop()
    event_loop, _thread = loop.current()
    event_loop.call_soon_threadsafe(event_loop.stop)
    poll(lambda: not _thread.is_alive(), 10, "the loop's thread to end")
    assert not pool.hand(lambda: None), "run on its slot instead"


def test_a_store_wait_parks_only_when_the_socket_is_not_ready_at_once() -> None:
    """``waits._drive``: psycopg's generator asks to read and write; a socket that can be
    written at once is not parked on (no turn of the loop); a read that must wait is."""
    a, b = socket.socketpair()
    parked: list[tuple[bool, bool]] = []

    def park(fileno: int, reading: bool, writing: bool) -> int:
        parked.append((reading, writing))
        b.send(b"answer")  # what the server would send meanwhile
        return READABLE

    def operation() -> Iterator[int]:
        ready = yield 3  # Wait.RW: send the query, or read an early answer
        assert ready == WRITABLE, "writable at once, nothing to read yet"
        ready = yield 1  # Wait.R: the answer
        assert ready == READABLE
        return len(a.recv(100))

    assert waits._drive(operation(), a.fileno(), park) == len(b"answer")
    assert parked == [(True, False)], "parked once, for the answer only"
    a.close()
    b.close()


def test_the_limits_gate_calls_its_limiter_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step naming limits, on the loop's own thread: taking room, giving it back (a
    refused lease, the body's end) and pausing a limit on a 429 each run on a thread of
    their own, so a limiter (Redis) that does not answer stalls no other attempt."""
    from types import SimpleNamespace

    from fleet.errors import Retry
    from fleet.worker import gate

    pool, _loop = _on_loop()
    calls: list[tuple[str, str]] = []

    class Limiter:
        def _saw(self, what: str) -> None:
            calls.append((what, threading.current_thread().name))

        def acquire(self, *_args: Any, **_kwargs: Any) -> None:
            self._saw("acquire")

        def release(self, *_args: Any) -> list[tuple[str, str]]:
            self._saw("release")
            return []

        def pause(self, _key: str, _seconds: float) -> None:
            self._saw("pause")

    limiter = Limiter()
    monkeypatch.setattr(gate, "limiter", lambda _rt: limiter)
    monkeypatch.setattr(gate, "wants", lambda *_args: [])
    llm = SimpleNamespace(rated=False, key=lambda _tenant: "llm")
    rt = SimpleNamespace(
        settings=SimpleNamespace(lease_seconds=30.0, visibility_timeout=3600.0),
        registry=SimpleNamespace(limits={"llm": llm}),
    )
    run = SimpleNamespace(id="r1", tenant="")
    step = SimpleNamespace(step_id="s#1")
    att = SimpleNamespace(
        rt=rt, run=run, run_id="r1", step_id="s#1", sd=SimpleNamespace(limits=("llm",))
    )

    def attempt() -> None:
        calls.append(("attempt", threading.current_thread().name))
        assert gate.admit(rt, run, step, att.sd)  # type: ignore[arg-type]
        gate.refused(rt, "r1", "s#1")  # type: ignore[arg-type]
        assert gate.admit(rt, run, step, att.sd)  # type: ignore[arg-type]
        with gate.holding(att):  # type: ignore[arg-type]
            pass
        gate.on_failure(att, Retry(1.0, limit="llm"))  # type: ignore[arg-type]

    assert pool.hand(attempt)
    assert pool.drain(10)
    assert calls[0] == ("attempt", "fleet-asyncio")
    assert [what for what, _ in calls[1:]] == ["acquire", "release", "acquire", "release", "pause"]
    assert all(thread.startswith("fleet-off-loop") for _, thread in calls[1:]), calls


def test_broker_sends_and_dead_letter_hooks_run_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From an attempt on the loop's own thread, every wake-up the dispatcher sends (a
    retry's countdown, a dead-lettered step's advance) and the application's
    ``on_dead_letter`` hooks run on a thread of their own: neither a broker that does
    not answer nor a slow hook stalls the steps awaiting on the loop."""
    from types import SimpleNamespace

    from fleet.store.step_ledger import LetterId
    from fleet.worker import failures
    from fleet.worker.dispatch import Dispatcher, Message

    pool, _loop = _on_loop()
    seen: list[tuple[str, str]] = []

    class Sender:
        def send(self, message: Message) -> None:
            seen.append((message.task, threading.current_thread().name))

        def waiting(self, _queues: Any) -> int:
            seen.append(("waiting", threading.current_thread().name))
            return 0

    dispatcher = Dispatcher(Sender())
    row = SimpleNamespace()
    rt = SimpleNamespace(
        ledger=SimpleNamespace(dead_letter=lambda *_a, **_k: LetterId(7, replay=False)),
        queries=SimpleNamespace(dead_letter=lambda _id: row),
        payloads=SimpleNamespace(load=lambda x: x),
        dead_letter_hooks=[lambda info: seen.append(("hook", threading.current_thread().name))],
    )
    failure = failures.Failure("ValueError", "no", None, "non-retryable", epoch=1)

    def attempt() -> None:
        seen.append(("attempt", threading.current_thread().name))
        dispatcher.execute("r1", "s#1", "q", shadow="w.s", countdown=0.5)
        dispatcher.advance("r1", "q")
        dispatcher.waiting(["q"])
        failures.dead_letter(rt, SimpleNamespace(id="r1", workflow="w"), "s#1", failure)  # type: ignore[arg-type]

    monkeypatch.setattr(failures.DeadLetterInfo, "from_row", staticmethod(lambda r, _load: r))
    assert pool.hand(attempt)
    assert pool.drain(10)
    assert seen[0] == ("attempt", "fleet-asyncio")
    assert [what for what, _ in seen[1:]] == ["fleet.execute", "fleet.advance", "waiting", "hook"]
    assert all(thread.startswith("fleet-off-loop") for _, thread in seen[1:]), seen


def test_an_attempt_parked_on_a_loop_that_stopped_gives_its_lease_up() -> None:
    """Its greenlet can never run again once the loop's thread has ended: the heartbeat
    gives the lease up at its next renewal rather than keep the step from every other
    worker until this one exits."""
    from types import SimpleNamespace

    from fleet.store.ledger import Lease
    from fleet.worker import process
    from fleet.worker.heartbeat import Heartbeat

    pool, loop = _on_loop()
    renewed = threading.Event()
    released: list[tuple[str, str, int]] = []

    class Ledger:
        def heartbeat(self, *_args: Any) -> bool:
            renewed.set()
            return True

        def release_lease(self, run_id: str, step_id: str, epoch: int) -> bool:
            released.append((run_id, step_id, epoch))
            return True

    rt: Any = SimpleNamespace(ledger=Ledger(), settings=SimpleNamespace(lease_seconds=0.3))
    lease = Lease("r1", "s#1", 3, 1, "s", "{}", False)
    parked: list[greenlet.greenlet] = []  # kept, as an awaited task's callback keeps it

    def attempt() -> None:
        with Heartbeat(rt, lease, process.current().beater):  # the process's one thread
            parked.append(greenlet.getcurrent())
            greenlet.getcurrent().parent.switch()  # parked, as on an await; never woken

    assert pool.hand(attempt)
    poll(renewed.is_set, 10, "a renewal while the loop runs")
    assert released == []
    event_loop, thread = loop.current()
    event_loop.call_soon_threadsafe(event_loop.stop)
    poll(lambda: not thread.is_alive(), 10, "the loop's thread to end")
    poll(lambda: released == [("r1", "s#1", 3)], 10, "the lease given up")
