"""What a real worker's log says (issue 48, item 21): each attempt's real outcome in
fleet's own lines, never Celery's "succeeded" for an attempt that failed, and no
kombu warning repeated at every wake-up. Both backends."""

from __future__ import annotations

from fleet import Fleet
from tests.harness import Backend, Cluster, poll


def test_a_failed_attempt_is_never_logged_as_a_success(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    worker = cluster.worker("w1")
    cluster.sweeper()
    runs = [client.enqueue("retrying", 1) for _ in range(3)]
    assert [run.wait(timeout=60) for run in runs] == [2, 2, 2]
    for run in runs:
        done = f"step flaky#1 of run {run.id} done: attempt 2, epoch 2"
        poll(lambda done=done: done in worker.output(), 10, "the attempt's done line")
    lines = worker.output().splitlines()
    for run in runs:
        failed = [line for line in lines if f"step flaky#1 of run {run.id} failed" in line]
        assert len(failed) == 1 and "retry in" in failed[0], failed
    assert not [line for line in lines if "succeeded in" in line], "Celery's line is reworded"
    ended = [line for line in lines if "Task fleet.execute[" in line or "Task retrying." in line]
    assert [line for line in ended if "] ended in " in line], "and says the task ended"
    assert "No hostname was supplied" not in worker.output()
