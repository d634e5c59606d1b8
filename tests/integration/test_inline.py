"""A task that finishes a step of a sequential run executes the run's next step itself
(no broker message), up to FLEET_INLINE_STEPS per task, and a new run's advance runs its
first step itself; a fan-out's items but the first are still sent, one message per
item, so any worker can take them."""

from __future__ import annotations

from typing import Any

import pytest

from fleet import Fleet, RunHandle
from fleet.worker import inline, process
from fleet.worker.dispatch import ADVANCE, EXECUTE
from fleet.worker.strands import Strands
from tests.harness import Backend, Cluster, InlineBroker, executions, poll


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


@pytest.fixture
def past_the_deadline(monkeypatch: pytest.MonkeyPatch, backend: Backend) -> None:
    """Every task is past INLINE_SECONDS after its first step; the process's answer to
    "do others wait?" is asked afresh."""
    monkeypatch.setenv("FLEET_TEST_LOG", str(backend.log_path))
    monkeypatch.setattr(inline, "INLINE_SECONDS", 0.0)
    monkeypatch.setattr(inline, "INLINE_RECHECK", 0.0)
    monkeypatch.setattr(inline, "_QUEUED", inline._Queued())


def _delivered_here(client: Fleet, steps: int) -> tuple[InlineBroker, RunHandle]:
    """A chain of ``steps`` enqueued, its advance message taken off the broker: the test
    delivers it by calling ``advance_steps`` as the worker's task would."""
    broker = InlineBroker(client)
    run = client.enqueue("chain", steps)
    assert broker.sent == [(ADVANCE, [run.id])]
    broker.sent.clear()
    return broker, run


def test_past_its_time_a_run_keeps_its_slot_while_nothing_waits_for_one(
    client: Fleet, past_the_deadline: None
) -> None:
    """A hand-back costs a message through the worker's consumer; with nobody waiting it
    would buy nothing, so the run goes on in its task (up to FLEET_INLINE_STEPS)."""
    broker, run = _delivered_here(client, 4)
    assert inline.advance_steps(client.runtime, run.id) == 4, "all four in the one task"
    assert broker.sent == []
    assert run.wait(timeout=0) == sum(i * i for i in range(4))


def test_past_its_time_a_run_hands_its_slot_back_when_a_message_waits(
    client: Fleet, past_the_deadline: None
) -> None:
    broker, run = _delivered_here(client, 4)
    other = client.enqueue("chain", 1)  # its advance waits on the queue
    # Seen after work#1, and still after work#2 (seen once, it may be passing through).
    assert inline.advance_steps(client.runtime, run.id) == 2, "handed back after work#2"
    assert broker.sent == [(ADVANCE, [other.id]), (EXECUTE, [run.id, "work#3"])]
    broker.drain()
    assert run.wait(timeout=0) == sum(i * i for i in range(4))
    assert other.wait(timeout=0) == 0


def test_past_its_time_a_run_on_a_strand_is_not_handed_back(
    client: Fleet, past_the_deadline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run going on on a strand holds no slot: with a message waiting it still keeps
    its async steps (a hand-back would only be one more message through the consumer);
    only its sync step after them is sent, to a slot."""
    pool = Strands()
    pool.configure(threads=1, capacity=10)
    monkeypatch.setattr(process.current(), "strands", pool)
    broker = InlineBroker(client)
    run = client.enqueue("async_chain", 4)
    other = client.enqueue("chain", 1)  # its advance waits on the queue throughout
    assert broker.sent[0] == (ADVANCE, [run.id])
    broker.sent.pop(0)
    # work#1 here; anap#1 kept and handed to the strand, which runs anap#1-#4.
    assert inline.advance_steps(client.runtime, run.id) == 1
    assert pool.drain(30), "the strand ran the async steps"
    assert broker.sent == [(ADVANCE, [other.id]), (EXECUTE, [run.id, "other#1"])]
    broker.drain()
    assert run.wait(timeout=0) == sum(i * i for i in range(4))


def test_past_its_time_a_run_hands_its_slot_back_when_the_broker_cannot_say(
    client: Fleet, past_the_deadline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker, run = _delivered_here(client, 4)

    def unreachable(queues: Any) -> int:
        raise ConnectionError("broker down")

    monkeypatch.setattr(broker, "waiting", unreachable)
    assert inline.advance_steps(client.runtime, run.id) == 2
    assert broker.sent == [(EXECUTE, [run.id, "work#3"])]


def test_a_message_seen_once_is_not_a_reason_to_hand_back(
    client: Fleet, past_the_deadline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message on the queue at one look and gone at the next was passing through (a
    run just handed back, taken at once): no slot was wanted. Answering yes to it made
    a worker's 500 runs hand back one after another, each one's message the next one's
    reason (bench.async_steps, c=500)."""
    broker, run = _delivered_here(client, 4)
    looks = iter([1, 0, 1, 0, 1])
    monkeypatch.setattr(broker, "waiting", lambda queues: next(looks))
    assert inline.advance_steps(client.runtime, run.id) == 4
    assert broker.sent == []


def test_two_looks_far_apart_are_not_in_a_row(
    client: Fleet, past_the_deadline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a look saw long ago says nothing of now: messages seen then and now may be
    different ones, each passing through."""
    monkeypatch.setattr(inline, "_IN_A_ROW", -1.0)  # every earlier look is too old
    broker, run = _delivered_here(client, 3)
    monkeypatch.setattr(broker, "waiting", lambda queues: 1)
    assert inline.advance_steps(client.runtime, run.id) == 3
