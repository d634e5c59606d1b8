"""The checks that decide whether a parked workflow may be resumed (fleet/worker/live.py),
and the bound on how many a process keeps; with stand-ins for the context and rows."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import greenlet
import pytest

from fleet.errors import StoreUnavailable
from fleet.worker import live as lives
from fleet.worker.live import Live, LiveRuns
from fleet.worker.workflow import PARKED

REGISTRY, DB = object(), object()


def _parked(start: int, ids: tuple[str, ...], pos: int, dirty: bool = False, held: int = 0) -> Live:
    talk = SimpleNamespace(held_bytes=held)
    ctx: Any = SimpleNamespace(
        run_id="r", parked=(start, ids), reached=pos, dirty=dirty, live=True, talk=talk
    )
    return Live(ctx, wf=Any, args=[], kwargs={}, registry=REGISTRY, db=DB, created_at=1.0)  # type: ignore[arg-type]


def _history(*ids: str) -> list[Any]:
    return [SimpleNamespace(step_id=i) for i in ids]


RT: Any = SimpleNamespace(registry=REGISTRY, db=DB)
RUN: Any = SimpleNamespace(created_at=1.0)


def test_a_parked_workflow_fits_the_history_that_holds_its_steps() -> None:
    assert _parked(1, ("b#1",), 2).fits(RT, RUN, _history("a#1", "b#1"))
    assert _parked(1, ("b#1",), 2).fits(RT, RUN, _history("a#1", "b#1", "c#1"))
    assert _parked(1, ("b#1", "b#2"), 3).fits(RT, RUN, _history("a#1", "b#1", "b#2"))


def test_it_does_not_fit_another_run_of_the_same_id() -> None:
    again: Any = SimpleNamespace(created_at=2.0)  # pruned, then enqueued again
    assert not _parked(1, ("b#1",), 2).fits(RT, again, _history("a#1", "b#1"))


def test_it_does_not_fit_a_history_without_what_it_reserved() -> None:
    # A record that rolled back, say: the position it parked on is not there.
    assert not _parked(1, ("b#1",), 2).fits(RT, RUN, _history("a#1"))
    assert not _parked(1, ("b#1", "b#2"), 3).fits(RT, RUN, _history("a#1", "b#1"))


def test_it_does_not_fit_a_history_with_other_steps_where_it_parked() -> None:
    assert not _parked(1, ("b#1",), 2).fits(RT, RUN, _history("a#1", "x#1"))


def test_a_context_handed_a_dead_step_never_fits() -> None:
    assert not _parked(1, ("b#1",), 2, dirty=True).fits(RT, RUN, _history("a#1", "b#1"))


def test_it_does_not_fit_another_registry_or_store() -> None:
    other: Any = SimpleNamespace(registry=object(), db=DB)
    assert not _parked(1, ("b#1",), 2).fits(other, RUN, _history("a#1", "b#1"))
    other = SimpleNamespace(registry=REGISTRY, db=object())
    assert not _parked(1, ("b#1",), 2).fits(other, RUN, _history("a#1", "b#1"))


def test_a_process_keeps_at_most_its_limit_and_drops_the_least_recent() -> None:
    runs = LiveRuns()
    kept = []
    for run_id in ("a", "b", "c"):
        live = _parked(0, ("s#1",), 1)
        live.ctx.run_id = run_id
        runs.keep(live, limit=2)
        kept.append(live)
    assert len(runs) == 2
    assert not runs.holds("a") and runs.holds("b") and runs.holds("c")
    # A dropped one is never resumed: if it parks again while it unwinds, it raises.
    assert kept[0].ctx.live is False and kept[2].ctx.live is True


def test_a_process_holds_at_most_its_bytes_of_outputs() -> None:
    runs = LiveRuns(max_bytes=100)
    for run_id, held in (("a", 40), ("b", 40), ("c", 40)):
        live = _parked(0, ("s#1",), 1, held=held)
        live.ctx.run_id = run_id
        runs.keep(live, limit=10)
    assert not runs.holds("a") and runs.holds("b") and runs.holds("c")
    assert runs.held_bytes == 80
    big = _parked(0, ("s#1",), 1, held=101)
    big.ctx.run_id = "big"
    runs.keep(big, limit=10)
    assert len(runs) == 0 and runs.held_bytes == 0, "one over the bound alone is not kept"
    assert big.ctx.live is False


def _started(unwound: list[str], run_id: str = "r") -> Live:
    """A live run whose workflow has parked in its greenlet, noting in ``unwound`` when
    it is unwound."""

    def body(ctx: Any) -> None:
        try:
            greenlet.getcurrent().parent.switch(PARKED)
        finally:
            unwound.append(ctx.run_id)

    live = _parked(0, ("s#1",), 1)
    live.ctx.run_id = run_id
    live.wf = SimpleNamespace(fn=body)  # type: ignore[assignment]
    assert live.run() is PARKED
    return live


def test_a_dropped_workflow_is_unwound_at_once_on_its_thread() -> None:
    """Fails without the unwinding in ``Live.drop``: a parked greenlet and its frames
    hold each other, so a dropped one waited for a full collection."""
    runs, unwound = LiveRuns(), []
    first = _started(unwound, "a")
    runs.keep(first, limit=1)
    runs.keep(_started(unwound, "b"), limit=1)
    assert unwound == ["a"] and first.glet is None
    runs.discard("b")
    assert unwound == ["a", "b"] and len(runs) == 0


def test_a_run_keeps_one_parked_workflow_that_of_its_latest_thread() -> None:
    """An async step's run moves from a slot's thread to the loop's: its parked copy on
    the slot is replaced, not kept beside (fails with entries by run and thread)."""
    runs, unwound = LiveRuns(), []
    run: Any = SimpleNamespace(id="r", created_at=1.0)
    on_slot = _parked(0, ("s#1",), 1)
    on_slot.thread = -1  # another thread's
    runs.keep(on_slot, limit=10)
    assert len(runs) == 1 and not runs.holds("r"), "held, but not for this thread"
    assert runs.take(RT, run, _history("s#1"), on_slot.wf) is None, "not resumed here"
    assert on_slot.ctx.live is False and len(runs) == 0
    on_slot.ctx.live = True
    runs.keep(on_slot, limit=10)
    here = _started(unwound)
    runs.keep(here, limit=10)
    assert len(runs) == 1 and runs.holds("r") and on_slot.ctx.live is False
    assert runs.take(RT, run, _history("s#1"), here.wf) is here
    assert unwound == []


def test_a_workflow_dropped_on_another_thread_is_unwound_by_its_own() -> None:
    """A parked greenlet is never let go on another thread (the greenlet library would
    kill it on its own thread at any greenlet call there, a switch included): it is
    handed over, and its thread unwinds it at its next ``take``. Fails without the
    hand-over: nothing unwinds it in ``take``, the library does, elsewhere."""
    runs, unwound, where = LiveRuns(), [], []
    parked, go, done = threading.Event(), threading.Event(), threading.Event()
    holder: list[Live] = []
    run: Any = SimpleNamespace(id="other", created_at=1.0)

    def slot() -> None:
        live = _started(unwound, "r")
        holder.append(live)
        parked.set()
        go.wait(10)
        unwound.append("before take")
        runs.take(RT, run, _history(), live.wf)  # a take of another run, on this thread
        where.append(threading.get_ident())
        done.set()

    thread = threading.Thread(target=slot)
    thread.start()
    assert parked.wait(10)
    (live,) = holder
    live.drop()  # on this thread: not its own
    assert live.glet is None and live.ctx.live is False
    holder.clear()
    del live
    assert unwound == [], "not unwound on a thread that is not its own"
    go.set()
    assert done.wait(10)
    thread.join(10)
    assert unwound == ["before take", "r"], "unwound by its own thread's next take"


def test_a_switch_that_is_not_the_workflow_s_is_refused() -> None:
    """A value that reaches ``Live.run`` while its workflow neither parked nor returned
    is another greenlet's (here a helper's end, its parent the caller): refused, and
    the run is left to be advanced again, never given that value as its result."""
    unwound: list[str] = []

    def body(ctx: Any) -> None:
        try:
            caller = greenlet.getcurrent().parent
            helper = greenlet.greenlet(lambda: "not the workflow's", parent=caller)
            helper.switch()  # it ends, and its value goes to the caller
            greenlet.getcurrent().parent.switch(PARKED)
        finally:
            unwound.append(ctx.run_id)

    live = _parked(0, ("s#1",), 1)
    live.wf = SimpleNamespace(fn=body)  # type: ignore[assignment]
    with pytest.raises(StoreUnavailable, match="switched away from"):
        live.run()
    assert live.glet is None and unwound == ["r"], "dropped and unwound"


def test_a_forked_child_does_not_wait_for_a_lock_its_parent_s_thread_held() -> None:
    """The child of a fork (Celery's prefork pool) drops its parent's parked workflows,
    one of another thread among them, while a thread of the parent held the orphans'
    lock: the child must not block on it (fails without new locks in the child)."""
    other = _parked(0, ("s#1",), 1)
    other.thread = -1  # another thread's: dropping it takes the orphans' lock
    other.glet = greenlet.greenlet(lambda: greenlet.getcurrent().parent.switch(PARKED))
    assert other.glet.switch() is PARKED
    lives.RUNS.keep(other, limit=10)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lives._ORPHANS_LOCK:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: the fork handlers have run, or it hangs here
            os._exit(0)
        deadline = time.monotonic() + 10
        done, status = 0, None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert status == 0 and done, "the child blocked on a lock the parent's thread held"
    finally:
        release.set()
        thread.join(10)
        lives.RUNS.clear()
        lives._ORPHANS.pop(-1, None)
