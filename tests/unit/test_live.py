"""The checks that decide whether a parked workflow may be resumed (fleet/worker/live.py),
the bound on how many a process keeps, and the lifecycle of a parked workflow on its
keeper (one thread each); with stand-ins for the context and rows."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from fleet.worker import live as lives
from fleet.worker.live import Live, LiveRuns
from fleet.worker.workflow import PARKED

REGISTRY, DB = object(), object()


KEPT = "parked on its keeper"  # a stand-in context's ``live`` until it is dropped


def _parked(
    start: int,
    ids: tuple[str, ...],
    pos: int,
    dirty: bool = False,
    held: int = 0,
    run_id: str = "r",
    body: Callable[[Any], Any] = lambda ctx: None,
) -> Live:
    talk = SimpleNamespace(held_bytes=held)
    ctx: Any = SimpleNamespace(
        run_id=run_id, parked=(start, ids), reached=pos, dirty=dirty, live=KEPT, talk=talk
    )
    wf: Any = SimpleNamespace(fn=body)
    return Live(ctx, wf, args=[], kwargs={}, registry=REGISTRY, db=DB, created_at=1.0)


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
        live = _parked(0, ("s#1",), 1, run_id=run_id)
        runs.keep(live, limit=2)
        kept.append(live)
    assert len(runs) == 2
    assert not runs.holds("a") and runs.holds("b") and runs.holds("c")
    # A dropped one is never resumed: if it parks again while it unwinds, it raises.
    assert kept[0].ctx.live is None and kept[2].ctx.live is KEPT


def test_a_process_holds_at_most_its_bytes_of_outputs() -> None:
    runs = LiveRuns(max_bytes=100)
    for run_id, held in (("a", 40), ("b", 40), ("c", 40)):
        runs.keep(_parked(0, ("s#1",), 1, held=held, run_id=run_id), limit=10)
    assert not runs.holds("a") and runs.holds("b") and runs.holds("c")
    assert runs.held_bytes == 80
    big = _parked(0, ("s#1",), 1, held=101, run_id="big")
    runs.keep(big, limit=10)
    assert len(runs) == 0 and runs.held_bytes == 0, "one over the bound alone is not kept"
    assert big.ctx.live is None


DEADLINE = 10.0  # seconds: the most a keeper takes to do what a test waits for


def _until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


class Story:
    """What a stand-in workflow did, and on which thread: ``parks`` times it parks (on
    its context's ``live``, as ``WorkflowContext._park`` does), then it returns
    ``done``; its unwinding is noted."""

    def __init__(self, parks: int = 1) -> None:
        self.parks = parks
        self.threads: list[str] = []
        self.unwound: list[str] = []

    def body(self, ctx: Any) -> str:
        try:
            for _ in range(self.parks):
                self.threads.append(threading.current_thread().name)
                ctx.live()
            self.threads.append(threading.current_thread().name)
            return "done"
        except lives.Dropped:
            self.unwound.append(threading.current_thread().name)
            raise


def _started(story: Story, run_id: str = "r") -> Live:
    """A live run whose workflow has parked on its keeper."""
    live = _parked(0, ("s#1",), 1, run_id=run_id, body=story.body)
    assert live.run() is PARKED and live.parked
    return live


def test_a_dropped_workflow_is_unwound_on_its_keeper_at_once() -> None:
    """Fails if a drop leaves the keeper parked: a dropped workflow would hold its
    thread and everything it was handed for the life of the process."""
    runs, first, second = LiveRuns(), Story(), Story()
    a = _started(first, "a")
    runs.keep(a, limit=1)
    runs.keep(_started(second, "b"), limit=1)  # "a" dropped for room
    _until(lambda: first.unwound != [], "the dropped workflow was not unwound")
    assert first.unwound == first.threads, "unwound on the thread it ran on, its keeper"
    assert first.threads[0] != threading.current_thread().name
    runs.discard("b")
    _until(lambda: second.unwound != [], "a discarded workflow was not unwound")
    assert len(runs) == 0 and runs.held_bytes == 0


def test_any_thread_resumes_a_parked_workflow_which_runs_on_its_keeper() -> None:
    """An async step's run moves from a slot's thread to the loop's: its workflow goes
    on, on the thread it started on, whoever advances it."""
    runs, story = LiveRuns(), Story(parks=2)
    run: Any = SimpleNamespace(id="r", created_at=1.0)
    live = _started(story)
    runs.keep(live, limit=10)
    got: list[Any] = []

    def slot() -> None:
        taken = runs.take(RT, run, _history("s#1"), live.wf)
        assert taken is live, "taken on another thread than the one that parked it"
        got.append(taken.run())
        runs.keep(taken, limit=10)

    thread = threading.Thread(target=slot)
    thread.start()
    thread.join(DEADLINE)
    assert got == [PARKED] and runs.holds("r")
    taken = runs.take(RT, run, _history("s#1"), live.wf)
    assert taken is live and taken.run() == "done"
    assert len(set(story.threads)) == 1 and story.unwound == []
    assert story.threads[0] not in (threading.current_thread().name, thread.name)


def test_a_workflow_s_error_is_raised_in_the_advancing_thread() -> None:
    def body(ctx: Any) -> None:
        ctx.live()
        raise ValueError("the workflow's own")

    live = _parked(0, ("s#1",), 1, body=body)
    assert live.run() is PARKED
    with pytest.raises(ValueError, match="the workflow's own"):
        live.run()
    assert not live.parked


def test_a_parked_workflow_nobody_keeps_is_unwound_when_collected() -> None:
    """An advance that failed after its workflow parked (its transaction rolled back)
    keeps nothing: fails without the drop at collection, the keeper then waiting for
    the life of the process."""
    story = Story()
    live = _started(story)
    del live
    gc.collect()
    _until(lambda: story.unwound != [], "a parked workflow let go was never unwound")


def test_an_advance_interrupted_while_it_waits_lets_the_workflow_go() -> None:
    """A slot's wait interrupted (a signal's exception, as a soft time limit raises):
    the workflow, still running on its keeper, is dropped where it next parks rather
    than parked for nobody."""
    go, story = threading.Event(), Story()

    def body(ctx: Any) -> Any:
        assert go.wait(DEADLINE)
        return story.body(ctx)

    class Interrupted(Exception):
        pass

    def interrupt(*_: Any) -> None:
        raise Interrupted

    live = _parked(0, ("s#1",), 1, body=body)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            live.run()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert live.keeper.dropped
    go.set()
    _until(lambda: story.unwound != [], "the workflow parked for nobody")


def test_a_park_from_another_thread_is_refused() -> None:
    live = _parked(0, ("s#1",), 1)
    with pytest.raises(RuntimeError, match="not its own"):
        live.keeper.park()


def test_a_forked_child_keeps_nothing_and_waits_for_no_lock_of_its_parent() -> None:
    """The child of a fork (Celery's prefork pool) starts with nothing kept, while a
    thread of the parent held the lock of what the parent keeps: the child must not
    block on it, nor touch its parent's keepers (fails if the child uses its parent's
    ``LiveRuns`` state)."""
    runs, story = LiveRuns(), Story()
    runs.keep(_started(story, "kept"), limit=10)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with runs._kept.lock:
            held.set()
            release.wait(DEADLINE)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(DEADLINE)
        pid = os.fork()
        if pid == 0:  # the child: exits 0 only if it keeps nothing and did not block
            code = 1
            try:
                runs.keep(_parked(0, ("s#1",), 1, run_id="child"), limit=10)
                code = 0 if not runs.holds("kept") and runs.holds("child") else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + DEADLINE
        done, status = 0, None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done, "the child blocked on a lock the parent's thread held"
        assert os.waitstatus_to_exitcode(status) == 0, "the child kept its parent's entries"
    finally:
        release.set()
        thread.join(DEADLINE)
    assert runs.holds("kept") and story.unwound == [], "the parent's keeper is untouched"
    runs.clear()
    _until(lambda: story.unwound != [], "cleared, but not unwound")
