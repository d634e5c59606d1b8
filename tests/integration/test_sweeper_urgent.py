"""A crash does not wait behind the backlog (fleet/worker/sweeper.py): the sweeper's
re-send of a step whose worker died (its lease expired while it ran) is urgent and,
on Redis, is taken before every routine message queued since; a re-send of anything
else takes its place at the end of the line. One message either way: only its place
in line differs."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from fleet import Fleet
from fleet.worker.dispatch import Message, queue_depths
from fleet.worker.replay import advance
from fleet.worker.sweeper import sweep_once
from tests.harness import Backend, Cluster, executions, wait_until

BACKLOG = 12


class _TakenByTheDeadWorker:
    """A sender whose messages a worker took and died with: none reaches a queue."""

    def send(self, message: Message) -> None:
        pass

    def waiting(self, queues: Sequence[str]) -> int:
        return 0


def test_a_step_whose_worker_died_runs_again_before_the_routine_backlog(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    if backend.kind == "sqlite":
        pytest.skip("the filesystem transport has no priorities: every message waits its turn")
    rt = client.runtime
    # No worker yet: a backlog of routine step messages (each run advanced here).
    for i in range(BACKLOG):
        client.enqueue("chain", 1, run_id=f"queued-{i}")
        advance(rt, f"queued-{i}")
    # A run whose step a worker took, then died: its messages are gone with it.
    routine = rt.dispatcher.use(_TakenByTheDeadWorker())
    try:
        client.enqueue("chain", 1, run_id="crashed")
        advance(rt, "crashed")
    finally:
        rt.dispatcher.use(routine)
    assert rt.ledger.take_lease("crashed", "work#1", "dead-worker", 0.2) is not None
    time.sleep(0.3)  # the lease runs out
    swept = wait_until(lambda: sweep_once(rt).steps, 10, "the sweeper to re-send the step")
    assert swept == 1

    cluster.worker("w1", concurrency=1)
    ids = [f"queued-{i}" for i in range(BACKLOG)] + ["crashed"]
    for rid in ids:
        client.run(rid).wait(timeout=60)
    starts = [e["run"] for e in executions(backend) if e["event"] == "start"]
    assert starts[0] == "crashed", f"the re-sent step waited behind the backlog: {starts}"
    assert sorted(starts) == sorted(ids)


def test_a_queue_depth_counts_urgent_and_routine_messages(backend: Backend, client: Fleet) -> None:
    """On Redis an urgent message waits on its queue's first priority list, a routine
    one on another: the depth is every message waiting, whichever list holds it."""
    rt = client.runtime
    queue = client.registry.workflow("chain").queue(client.settings.queue)
    idle = client.registry.workflow("refusing").queue(client.settings.queue)
    assert rt.dispatcher.advance("routine", queue)
    assert rt.dispatcher.advance("urgent", queue, urgent=True)
    assert rt.dispatcher.execute("urgent", "work#1", queue, shadow="chain.work", urgent=True)
    assert queue_depths(client.celery, [queue, idle]) == {queue: 3, idle: 0}
    assert rt.dispatcher.waiting([queue, idle]) == 3
