"""A task that finishes a step of a sequential run executes the run's next step itself
(no broker message), up to FLEET_INLINE_STEPS per task, and a new run's advance runs its
first step itself; a fan-out's items but the first are still sent, one message per
item, so any worker can take them."""

from __future__ import annotations

from fleet import Fleet
from tests.harness import Backend, Cluster, executions, poll


def _received_lines(cluster: Cluster) -> list[str]:
    """The step messages the workers took from the broker: Celery logs each one under
    its shadow name (``workflow.step_name``); run wake-ups show as ``advance:<queue>``."""
    return [
        line
        for p in cluster.procs
        for line in p.output().splitlines()
        if "celery.worker.strategy: Task " in line
        and line.endswith(" received")
        and "Task advance:" not in line
    ]


def test_a_sequential_run_takes_one_message_per_task_of_steps(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=1)
    run = client.enqueue("chain", 6)
    assert run.wait(timeout=60) == sum(i * i for i in range(6))
    assert _received_lines(cluster) == [], "steps 1-6 ran in the advance's task, no message"
    assert len({e["pid"] for e in executions(backend, run.id)}) == 1


def test_the_inline_cap_hands_the_run_back_to_the_queue(backend: Backend, cluster: Cluster) -> None:
    from tests.harness import client_for

    backend.extra_env["FLEET_INLINE_STEPS"] = "2"
    client = client_for(backend)
    cluster.worker("w1", concurrency=1)
    run = client.enqueue("chain", 5)
    assert run.wait(timeout=60) == sum(i * i for i in range(5))
    assert len(_received_lines(cluster)) == 2, "two steps per task: 1-2 (the advance), 3-4, 5"


def test_a_fan_out_is_still_sent_item_by_item(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=4)
    run = client.enqueue("fan", 3)
    assert run.wait(timeout=60)["n"] == 3
    poll(lambda: len(_received_lines(cluster)) >= 2, 10, "the fan-out's messages")
    assert len(_received_lines(cluster)) == 2, "items 2 and 3 sent; 1 in the advance's task"


def test_a_kept_step_whose_worker_died_before_taking_it_is_sent_by_the_sweeper(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """Invariant 1: a step kept for inline execution is never sent, so if its worker dies
    before taking it only the store knows of it; the sweeper must send it."""
    from fleet.worker.replay import replay_run

    run = client.enqueue("chain", 2)
    replayed = replay_run(client.runtime, run.id)  # records work#1, sends nothing
    assert replayed is not None
    kept = [task.step_id for task in replayed.tasks]
    assert kept == ["work#1"]
    assert not executions(backend, run.id)
    cluster.worker("w1", concurrency=1)
    cluster.sweeper()
    assert run.wait(timeout=60) == 0 + 1
