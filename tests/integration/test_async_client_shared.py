"""What the async client's calls share (issue #20), on both backends: concurrent
``aenqueue`` calls are inserted in one statement of one transaction, each call keeping
its own outcome (a refusal, a duplicate id, a failed insert are that call's alone); and
every ``aresult`` / ``astatus`` on a loop shares one read per round, each waiter getting
what ``wait`` / ``status`` would have, a cancelled one dropped at once, none holding a
thread while it waits."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event

from fleet import (
    BadInput,
    Fleet,
    RunFailed,
    RunHandle,
    StoreUnavailable,
    UnknownRun,
    WaitTimeout,
    aio_client,
)
from fleet.aio_client import OffLoop
from tests.harness import Backend, Cluster, poll, starts


class Statements:
    """The SQL the client's engine ran while counting, as text."""

    def __init__(self, client: Fleet) -> None:
        self.engine = client.runtime.db.engine
        self.seen: list[str] = []
        event.listen(self.engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        self.seen.append(" ".join(statement.split()))

    def count(self, start: str) -> int:
        return sum(s.startswith(start) for s in self.seen)

    def close(self) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)


@pytest.fixture
def statements(client: Fleet) -> Iterator[Statements]:
    counted = Statements(client)
    yield counted
    counted.close()


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        return "ok", repr(call())
    except Exception as exc:
        return type(exc).__name__, str(exc)


async def _held(client: Fleet, calls: list[Awaitable[Any]]) -> list[Any]:
    """``calls`` made while the Fleet's threads are all busy, so that they are waiting
    together when a thread frees up (the batch a burst makes, deterministically)."""
    release = threading.Event()
    for _ in range(client.off_loop.threads):
        client.off_loop.submit(lambda: None if release.wait(30) else None)
    tasks = [asyncio.ensure_future(c) for c in calls]
    while len(client.enqueues._pending) < len(calls):
        await asyncio.sleep(0.005)
    release.set()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


def test_a_burst_of_aenqueues_is_one_insert_and_each_call_keeps_its_outcome(
    backend: Backend, client: Fleet, cluster: Cluster, statements: Statements
) -> None:
    client.enqueue("fan", 1, run_id="taken")  # another workflow's run
    statements.seen.clear()
    calls: list[Callable[[Fleet], Awaitable[Any]]] = [
        *(lambda f, i=i: f.aenqueue("chain", 1, run_id=f"new-{i}") for i in range(20)),
        *(lambda f: f.aenqueue("chain", 2, run_id="twice") for _ in range(3)),
        lambda f: f.aenqueue("chain", 1, run_id="taken"),
        lambda f: f.aenqueue("chain"),  # a missing argument
        lambda f: f.aenqueue("nope"),
        lambda f: f.aenqueue("chain", 1, run_id="a/b"),
    ]
    got = asyncio.run(_held(client, [call(client) for call in calls]))

    assert statements.count("INSERT INTO fleet_runs") == 1, "one statement for the burst"
    ids = [g.id for g in got[:23]]
    assert ids == [f"new-{i}" for i in range(20)] + ["twice"] * 3
    # The refusals are those the sync calls give, word for word, each to its caller.
    sync = [
        _outcome(lambda: client.enqueue("chain", 1, run_id="taken")),
        _outcome(lambda: client.enqueue("chain")),
        _outcome(lambda: client.enqueue("nope")),
        _outcome(lambda: client.enqueue("chain", 1, run_id="a/b")),
    ]
    assert [(type(e).__name__, str(e)) for e in got[23:]] == sync
    assert all(isinstance(e, BadInput) for e in got[23:])
    runs = {r.id: r.workflow for r in client.runtime.queries.runs(limit=100)}
    assert runs == {"taken": "fan", "twice": "chain", **{f"new-{i}": "chain" for i in range(20)}}
    # Each new run woken once: a worker runs each once, "twice" too.
    cluster.worker("w1")
    assert asyncio.run(client.run("twice").aresult(timeout=60)) == 1
    for i in (0, 19):
        run = client.run(f"new-{i}")
        assert asyncio.run(run.aresult(timeout=60)) == run.wait(timeout=0)
        assert starts(backend, run.id) == {"work#1": 1}
    assert starts(backend, "twice") == {"work#1": 1, "work#2": 1}


def test_a_failed_batch_is_tried_call_by_call_and_one_failure_stays_its_own(
    backend: Backend, client: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's transaction fails (a deadlock Postgres broke, say): each call is
    inserted again on its own, and the one whose insert fails alone gets that error;
    the others' runs are there."""
    ledger_type = type(client.runtime.ledger)
    create_runs = ledger_type.create_runs

    def broken(self: Any, new: Any) -> set[str]:
        if len(new) > 1:  # the batch's insert; one run alone (enqueue's) goes in
            raise StoreUnavailable("deadlock detected (a stand-in)")
        return create_runs(self, new)

    monkeypatch.setattr(ledger_type, "create_runs", broken)
    create_alone = aio_client.create_run

    def alone(run: Any, ledger: Any, queries: Any) -> bool:
        if run.run_id == "doomed":
            raise StoreUnavailable("the store went away for this one")
        return create_alone(run, ledger, queries)

    monkeypatch.setattr(aio_client, "create_run", alone)
    ids = ["a", "doomed", "b", "c"]
    got = asyncio.run(_held(client, [client.aenqueue("chain", 1, run_id=i) for i in ids]))
    assert [g.id if not isinstance(g, Exception) else str(g) for g in got] == [
        "a",
        "the store went away for this one",
        "b",
        "c",
    ]
    assert sorted(r.id for r in client.runtime.queries.runs(limit=10)) == ["a", "b", "c"]


def test_many_waiters_share_one_read_per_round_and_hold_no_thread(
    backend: Backend, client: Fleet, statements: Statements
) -> None:
    """400 ``aresult`` waiters and 200 ``astatus`` on 4 runs that do not move (no
    worker), on a pool of one thread: a few shared reads in all (one per round, not one
    per waiter per round), each waiter times out as ``wait`` does, and an ``aenqueue``
    made while 200 of them wait for ever is not held up by them."""
    client.off_loop = OffLoop(1)
    handles = [client.enqueue("chain", 1) for _ in range(4)]
    expected = [_outcome(functools.partial(h.wait, timeout=0.8)) for h in handles]
    statements.seen.clear()

    async def go() -> tuple[list[Any], list[str], str]:
        forever = [
            asyncio.ensure_future(h.aresult(timeout=None)) for _ in range(50) for h in handles
        ]
        waits = [h.aresult(timeout=0.8) for _ in range(50) for h in handles]
        waiting = asyncio.gather(*waits, return_exceptions=True)
        statuses = await asyncio.gather(*[h.astatus() for _ in range(50) for h in handles])
        meanwhile = await asyncio.wait_for(client.aenqueue("chain", 1, run_id="meanwhile"), 30)
        done = await waiting
        assert not any(f.done() for f in forever)
        for f in forever:
            f.cancel()
        return list(done), statuses, meanwhile.id

    done, statuses, meanwhile = asyncio.run(go())
    assert meanwhile == "meanwhile" and statuses == ["queued"] * 200
    assert [(type(e).__name__, str(e)) for e in done] == expected * 50
    assert all(isinstance(e, WaitTimeout) for e in done)
    reads = statements.count("SELECT fleet_runs.id, fleet_runs.status")
    # One read per round: the first, then as the waiters' reads slow down (0.05 s,
    # growing by half each time) over 0.8 s: about ten in all, where 600 waiters each
    # reading on its own would make 600 in their first round alone.
    assert 1 <= reads <= 25, reads


def test_waiters_get_what_wait_gets_and_a_cancelled_one_is_dropped(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    good, bad = client.enqueue("chain", 2), client.enqueue("refusing")
    stuck = client.enqueue("approval")  # waits for a signal that never comes
    ghost = RunHandle(client, "ghost")

    async def go() -> tuple[list[Any], list[int]]:
        waits = [run.aresult(timeout=60) for run in (good, bad, ghost) for _ in range(10)]
        kept, dropped = (asyncio.ensure_future(stuck.aresult(timeout=None)) for _ in "ab")
        done = await asyncio.gather(*waits, return_exceptions=True)
        poller = client.waiters._pollers[asyncio.get_running_loop()]
        counts = [len(poller.waiters)]
        dropped.cancel()
        await _settled(lambda: len(poller.waiters) < counts[0])
        counts.append(len(poller.waiters))
        with pytest.raises(TimeoutError):  # asyncio's timeout cancels its waiter too
            await asyncio.wait_for(stuck.aresult(timeout=None), 0.2)
        counts.append(len(poller.waiters))
        kept.cancel()
        return done, counts

    done, counts = asyncio.run(go())
    outcomes = [(type(e).__name__, str(e)) for e in done[10:]]
    assert done[:10] == [good.wait(timeout=0)] * 10
    assert (
        outcomes
        == [_outcome(lambda: bad.wait(timeout=0))] * 10
        + [_outcome(lambda: ghost.wait(timeout=0))] * 10
    )
    assert isinstance(done[10], RunFailed) and isinstance(done[20], UnknownRun)
    assert counts == [2, 1, 1], "a cancelled waiter leaves at once"
    # Once none waits, the poller is gone (its loop closed too).
    poll(lambda: not client.waiters._pollers, 5, "the poller to go")


async def _settled(check: Callable[[], bool], turns: int = 100) -> None:
    """A few turns of the loop until ``check`` holds (callbacks run a turn later)."""
    for _ in range(turns):
        if check():
            return
        await asyncio.sleep(0)
