"""On a threads-pool worker an awaiting ``async def`` step holds no slot: its attempt
goes on as a greenlet on a strand (``fleet/worker/strands.py``; on Postgres on the
event loop's own thread, ``fleet/worker/on_loop.py``). More steps await at once than
the worker has slots, no sync step ever runs off a slot, and a warm shutdown
waits for the attempts off the slots as for its slots' own. Real workers, both
backends."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from fleet import Fleet
from tests.harness import Backend, Cluster, executions, find_event, poll, starts


def _most_at_once(events: list[dict[str, Any]], step: str) -> int:
    edges = sorted(
        (e["t"], 1 if e["event"] == "start" else -1)
        for e in events
        if e["step"].startswith(step) and e["event"] in ("start", "end")
    )
    running = most = 0
    for _, step_edge in edges:
        running += step_edge
        most = max(most, running)
    return most


@pytest.mark.parametrize("awaiting", ["1000", "0"], ids=["off-the-slots", "on-the-slots"])
def test_awaiting_steps_hold_no_slot(
    backend: Backend, client: Fleet, cluster: Cluster, awaiting: str
) -> None:
    backend.extra_env["FLEET_ASYNC_AWAITING"] = awaiting
    cluster.worker("w1", concurrency=2)
    run = client.enqueue("async_crowd", 6, 2.0)
    out = run.wait(timeout=90)
    assert out["sum"] == sum(range(6))
    most = _most_at_once(executions(backend, run.id), "anap_item")
    if awaiting == "0":
        assert most == 2, "FLEET_ASYNC_AWAITING=0: each awaiting step holds one of 2 slots"
    else:
        assert most == 6, "six await at once on a worker of two slots"
    # Off the slots async attempts run on strands (SQLite) or on the loop's thread
    # (Postgres): a sync body on either would block the others.
    off_slots = ("fleet-strand", "fleet-asyncio", "fleet-off-loop")
    assert not any(t.startswith(off_slots) for t in out["threads"]), (
        f"a sync step ran on a strand or on the loop's thread: {out['threads']}"
    )
    assert set(starts(backend, run.id).values()) == {1}, "each step ran once"


def test_a_warm_shutdown_waits_for_an_async_step_off_its_slot(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    backend.extra_env["FLEET_SHUTDOWN_GRACE"] = "15"
    leaving = cluster.worker("w1", concurrency=2)
    run = client.enqueue("async_chain", 1, 0, 2.0)  # anap#1 awaits 2 s on attempt 1
    poll(lambda: find_event(backend, run.id, "anap#1", "start"), 30, "anap#1 to start")
    leaving.signal(signal.SIGTERM)
    poll(lambda: not leaving.alive, 30, "the worker to finish its step and leave")
    step = client.runtime.queries.step(run.id, "anap#1")
    assert step is not None and step.status == "done", "committed before the process left"
    assert "lease(s) released" not in leaving.output()
    cluster.worker("w2")
    assert run.wait(timeout=60) == 0
    assert starts(backend, run.id) == {"work#1": 1, "anap#1": 1, "other#1": 1}
