"""``async def`` steps run on the process's one event loop, in its own thread: values and
errors come back to the slot that waits, a lost lease cancels the coroutine at once, the
slot's context goes with it, a forked child gets a loop of its own, and a sync function
returning a coroutine is refused naming the step. A fake ledger; no services."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from fleet import BadInput, Fleet, NonRetryable, Retry, Settings
from fleet.aio_client import GIVE_WAY_AFTER, GIVE_WAY_FOR, GiveWay
from fleet.secrets import current_redactor, redacting
from fleet.store.ledger import Lease
from fleet.worker import aio, process
from fleet.worker.aio import EventLoop, Runner
from fleet.worker.context import LeaseLost
from fleet.worker.heartbeat import Heartbeat

_PROC = process.current()


class FakeLedger:
    """Renews every lease until ``answer`` turns False (taken over, revoked)."""

    def __init__(self) -> None:
        self.answer = True

    def heartbeat(self, run_id: str, step_id: str, epoch: int, lease_seconds: float) -> bool:
        return self.answer


def _heartbeat(ledger: FakeLedger, step_id: str = "s#1", lease: float = 60.0) -> Heartbeat:
    rt: Any = SimpleNamespace(ledger=ledger, settings=SimpleNamespace(lease_seconds=lease))
    return Heartbeat(rt, Lease("run", step_id, 1, 1, "s", "{}", False), _PROC.beater)


def _runner(hb: Heartbeat, step: str = "fetch") -> Runner:
    return Runner(_PROC.loop, hb, step)


def test_an_async_function_runs_on_the_loop_thread_and_a_sync_one_here() -> None:
    async def on_loop(x: int) -> tuple[int, int]:
        await asyncio.sleep(0)
        return x * 2, threading.get_ident()

    def here(x: int) -> tuple[int, int]:
        return x + 1, threading.get_ident()

    with _heartbeat(FakeLedger()) as hb:
        value, where = _runner(hb)(on_loop, 21)
        assert value == 42 and where != threading.get_ident()
        loop, thread = _PROC.loop.current()
        assert where == thread.ident and thread.name == "fleet-asyncio" and thread.daemon
        assert _runner(hb)(here, 1) == (2, threading.get_ident()), "a sync step stays here"


def test_an_object_whose_call_is_async_runs_on_the_loop_too() -> None:
    class Client:
        async def __call__(self, ctx: Any) -> int:
            return threading.get_ident()

    with _heartbeat(FakeLedger()) as hb:
        assert _runner(hb)(Client(), None) == _PROC.loop.current()[1].ident


def test_slots_share_one_loop_and_await_at_the_same_time() -> None:
    seen: list[tuple[int, int]] = []

    async def nap() -> None:
        seen.append((id(asyncio.get_running_loop()), threading.get_ident()))
        await asyncio.sleep(0.4)

    ledger = FakeLedger()

    def slot() -> None:
        with _heartbeat(ledger) as hb:
            _runner(hb)(nap)

    slots = [threading.Thread(target=slot) for _ in range(8)]
    began = time.monotonic()
    for t in slots:
        t.start()
    for t in slots:
        t.join(10)
    took = time.monotonic() - began
    assert len(seen) == 8 and len(set(seen)) == 1, "one loop, one thread, for every slot"
    assert took < 1.5, f"eight 0.4 s awaits took {took:.2f} s: they did not overlap"


def test_what_the_coroutine_raises_reaches_the_slot_as_itself() -> None:
    async def asks_again() -> None:
        raise Retry(delay=3, reason="rate limited")

    async def stops() -> None:
        raise SystemExit(3)

    with _heartbeat(FakeLedger()) as hb:
        with pytest.raises(Retry, match="rate limited") as caught:
            _runner(hb)(asks_again)
        assert caught.value.delay == 3
        # Would stop the loop for every slot if it escaped the task: it is a failure.
        with pytest.raises(RuntimeError, match="SystemExit"):
            _runner(hb)(stops)
        assert _runner(hb)(asyncio.sleep, 0, "still serving") == "still serving"


def test_a_lost_lease_cancels_the_awaiting_coroutine_at_once() -> None:
    ledger = FakeLedger()
    cancelled = threading.Event()

    async def long_call() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    with _heartbeat(ledger, "slow#1", lease=0.15) as hb:
        threading.Timer(0.2, lambda: setattr(ledger, "answer", False)).start()
        began = time.monotonic()
        with pytest.raises(LeaseLost, match="slow#1 of run run lost its lease .* cancelled"):
            _runner(hb)(long_call)
        took = time.monotonic() - began
    assert cancelled.is_set(), "the coroutine saw its cancellation"
    assert took < 1.0, f"cancelled {took:.2f} s after it started (renewals every 0.05 s)"


@pytest.mark.parametrize("how", ["returns", "never ends"])
def test_a_coroutine_swallowing_its_cancel_is_named_once_and_gives_its_slot_back(
    how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(aio, "CANCEL_GRACE", 0.3)
    ledger = FakeLedger()
    stop = threading.Event()

    async def deaf() -> str:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                if how == "returns":
                    return "swallowed"
        return "stopped"

    try:
        with _heartbeat(ledger, "deaf#1", lease=0.15) as hb:
            threading.Timer(0.2, lambda: setattr(ledger, "answer", False)).start()
            with pytest.raises(LeaseLost, match="deaf#1 of run run lost its lease"):
                _runner(hb)(deaf)
    finally:
        stop.set()  # the one left running on the loop ends with the test
    named = [r.getMessage() for r in caplog.records if "deaf#1" in r.getMessage()]
    assert not [line for line in named if "while awaiting" in line], "one line, not two"
    lines = [line for line in named if "swallowed" in line]
    assert len(lines) == 1, named
    if how == "returns":
        assert lines[0] == (
            "step deaf#1 of run run swallowed the CancelledError fleet sent when its lease "
            "was lost: it returned instead (its write is fenced)"
        )
    else:
        assert "did not end within 0.3s of being cancelled (its lease lost)" in lines[0]
        assert "its slot is given back" in lines[0]
    assert "step deaf#1 of run run" not in _PROC.loop.awaiting.names()


def test_the_watchdog_names_the_step_holding_the_loop_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = EventLoop()
    loop.watch(0.2)

    async def blocking() -> int:
        time.sleep(0.8)
        return 1

    async def polite() -> int:
        await asyncio.sleep(0.05)
        return 2

    with _heartbeat(FakeLedger(), "block#1") as hb:
        assert Runner(loop, hb, "block")(blocking) == 1
        assert Runner(loop, hb, "polite")(polite) == 2
        # The watchdog looks every 0.05 s: long enough for a second line, if it wrote one.
        time.sleep(0.3)
    held = [r for r in caplog.records if "event loop held" in r.getMessage()]
    assert len(held) == 1, [r.getMessage() for r in held]
    assert held[0].levelname == "WARNING"
    line = held[0].getMessage()
    assert line.startswith("event loop held over 0.2s by step block#1 of run run: an `async")


def test_a_lease_already_lost_cancels_the_coroutine_as_it_starts() -> None:
    ledger = FakeLedger()
    ledger.answer = False
    with _heartbeat(ledger, "late#1") as hb:
        assert not hb.beat()

        async def never_finishes() -> None:
            await asyncio.sleep(30)

        with pytest.raises(LeaseLost):
            _runner(hb)(never_finishes)


def test_a_released_lease_does_not_cancel_the_coroutine() -> None:
    """At shutdown a lease is given up but the attempt may still commit (the epoch
    decides): its coroutine runs on, as a sync step's body does."""
    rt: Any = SimpleNamespace(
        ledger=SimpleNamespace(release_lease=lambda *a: True, heartbeat=lambda *a: True),
        settings=SimpleNamespace(lease_seconds=60.0),
    )
    hb = Heartbeat(rt, Lease("run", "r#1", 1, 1, "r", "{}", False), _PROC.beater)

    async def finishes() -> str:
        await asyncio.sleep(0.2)
        return "done"

    with hb:
        threading.Timer(0.05, hb.release).start()
        assert _runner(hb)(finishes) == "done"


def test_the_slot_s_context_goes_with_the_coroutine() -> None:
    """The attempt's redactor (the secrets its step reveals are masked in what it
    records) is the coroutine's too, not the loop thread's (none)."""

    async def which() -> Any:
        return current_redactor()

    with _heartbeat(FakeLedger()) as hb, redacting() as redactor:
        assert _runner(hb)(which) is redactor


def test_a_sync_function_returning_a_coroutine_is_refused_naming_the_step() -> None:
    async def inner(ctx: Any) -> int:
        return 1

    def wrapper(ctx: Any) -> Any:  # a decorator that lost the ``async def``
        return inner(ctx)

    with _heartbeat(FakeLedger()) as hb, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NonRetryable) as refused:
            _runner(hb, "wrapped")(wrapper, None)
        gc.collect()
    assert str(refused.value) == "step 'wrapped' returned a coroutine: declare it `async def`"
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_async_steps_are_refused_on_a_gevent_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    patched = SimpleNamespace(is_module_patched=lambda name: name == "threading")
    monkeypatch.setitem(sys.modules, "gevent.monkey", patched)

    async def step(ctx: Any) -> int:
        return 1

    with _heartbeat(FakeLedger()) as hb, pytest.raises(NonRetryable, match="gevent pool"):
        _runner(hb, "g")(step, None)


def test_a_forked_child_runs_its_async_steps_on_a_loop_of_its_own() -> None:
    loop = EventLoop()
    parent_loop, parent_thread = loop.current()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's loop thread is not here
        try:
            child_loop, child_thread = loop.current()
            ok = child_loop is not parent_loop and child_thread.is_alive()
            with _heartbeat(FakeLedger()) as hb:
                ok = ok and loop.run(asyncio.sleep(0, "child"), hb, "step") == "child"
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 2) == b"ok"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert loop.current() == (parent_loop, parent_thread), "the parent keeps its loop"


def test_an_async_workflow_is_refused_at_definition(tmp_path: Any) -> None:
    app = Fleet("aio-unit", settings=Settings(database_url=f"sqlite:///{tmp_path}/f.db"))
    with pytest.raises(BadInput) as refused:

        @app.workflow(version="1")
        async def flow(wf: Any) -> None:
            return None

    assert str(refused.value) == (
        "workflow 'flow' is `async def`: a workflow is a plain function replayed "
        "deterministically; make its steps `async def` instead"
    )
    with pytest.raises(BadInput, match="async generator"):

        @app.step
        async def chunks(ctx: Any) -> Any:
            yield 1

    @app.step
    async def fine(ctx: Any) -> int:
        return 1

    assert app.registry.steps["fine"].fn is not None


def test_a_batch_gives_way_once_it_has_worked_long() -> None:
    """A batch pauses between two pieces of work once it has worked ``GIVE_WAY_AFTER``
    since its last pause, and not before; each batch counts its own time."""
    now = [0.0]
    pauses: list[float] = []
    give_way = GiveWay(clock=lambda: now[0], pause=pauses.append)
    now[0] = GIVE_WAY_AFTER / 2
    give_way()
    assert pauses == [], "a batch that has worked less than GIVE_WAY_AFTER does not pause"
    now[0] = GIVE_WAY_AFTER
    give_way()
    assert pauses == [GIVE_WAY_FOR]
    give_way()
    assert len(pauses) == 1, "the time is counted again from the pause"
    GiveWay(clock=lambda: now[0], pause=pauses.append)()
    assert len(pauses) == 1, "another batch counts its own time"
