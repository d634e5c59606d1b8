"""Invariants 1 and 3 under fire: real workers killed, frozen, and messages duplicated
or wiped, on both backends."""

from __future__ import annotations

import signal

from fleet import Fleet
from fleet.records import saved_by_resume
from fleet.worker.replay import advance, step_shadow
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, Cluster, executions, find_event, poll, starts

N = 12
EXPECTED = sum(i * i for i in range(N))


def test_sigkill_mid_step_resumes_at_that_step(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    k = 6  # work#7 holds its first attempt long enough to be killed in it
    run = client.enqueue("chain", N, 0.0, k, 60.0)
    victim = poll(
        lambda: find_event(backend, run.id, f"work#{k + 1}", "start", attempt=1),
        30,
        f"work#{k + 1} to start",
    )
    cluster.by_pid(victim["pid"]).signal(signal.SIGKILL)

    assert run.wait(timeout=60) == EXPECTED
    ran = starts(backend, run.id)
    for i in range(1, N + 1):
        if i == k + 1:
            assert ran[f"work#{i}"] == 2, "the killed step runs again, once"
        else:
            assert ran[f"work#{i}"] == 1, f"work#{i} ran {ran[f'work#{i}']} times"
    killed = next(s for s in run.steps() if s.id == f"work#{k + 1}")
    assert (killed.status, killed.attempts, killed.epoch) == ("done", 2, 2)
    assert client.runtime.queries.incident_counts(run.id).get("takeover") == 1
    # work#i records 10 + i tokens as it starts: the killed attempt's spend is kept (it
    # was really spent), and resuming saved what the six checkpointed steps had spent.
    assert run.usage()["tokens"] == sum(10 + i for i in range(N)) + (10 + k)
    saved = saved_by_resume(client.runtime.queries.attempts(run.id))
    assert (saved["crashes"], saved["steps"], saved["tokens"]) == (
        1,
        k,
        sum(10 + i for i in range(k)),
    )
    status = fleet_cli(backend, "status", run.id)
    assert "saved by resume" in status.stdout and "6 checkpointed step(s)" in status.stdout


def test_frozen_worker_is_fenced_when_it_wakes(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    # linger#1's first attempt sleeps 3 s against a 2 s lease; the takeover sleeps 5 s,
    # so the zombie, woken as soon as the takeover starts, tries to commit while the
    # epoch-2 attempt still holds the step.
    run = client.enqueue("frozen", 3.0, 5.0)
    first = poll(
        lambda: find_event(backend, run.id, "linger#1", "start", attempt=1),
        30,
        "linger#1 to start",
    )
    zombie = cluster.by_pid(first["pid"])
    zombie.signal(signal.SIGSTOP)
    poll(
        lambda: find_event(backend, run.id, "linger#1", "start", epoch=2),
        30,
        "another worker to take linger#1 over at epoch 2",
    )
    zombie.signal(signal.SIGCONT)

    assert run.wait(timeout=60) == 2, "the workflow saw the epoch-2 attempt's output"
    zombie_end = find_event(backend, run.id, "linger#1", "end", epoch=1)
    takeover_end = find_event(backend, run.id, "linger#1", "end", epoch=2)
    assert zombie_end and takeover_end
    assert executions(backend, run.id).index(zombie_end) < executions(backend, run.id).index(
        takeover_end
    ), "the zombie finished first, while the takeover held the lease"
    q = client.runtime.queries
    outcomes = {a.epoch: a.outcome for a in q.attempts(run.id) if a.step_id == "linger#1"}
    assert outcomes == {1: "fenced", 2: "done"}
    step = q.step(run.id, "linger#1")
    assert step is not None and step.epoch == 2 and step.output == '{"epoch":2}'
    assert q.incident_counts(run.id).get("fenced_write") == 1


def test_duplicate_execute_delivery_runs_once(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    run = client.enqueue("chain", 1, 1.0)
    advance(client.runtime, run.id)  # records work#1 and sends its execute message
    # ... and the same message once more, as a broker redelivery would.
    client.runtime.dispatcher.execute(
        run.id, "work#1", "fleet", shadow=step_shadow("chain", "work#1")
    )
    cluster.worker("w1", concurrency=4)

    assert run.wait(timeout=60) == 0
    assert starts(backend, run.id)["work#1"] == 1
    counts = client.runtime.queries.incident_counts(run.id)
    assert counts.get("duplicate_delivery", 0) >= 1


def test_broker_wiped_mid_run_the_sweeper_recovers(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=1)
    run = client.enqueue("fan", 6, 0.5)
    poll(lambda: starts(backend, run.id), 30, "the fan-out to start")
    poll(lambda: backend.queued_messages() > 0, 10, "fan-out messages waiting in the broker")
    backend.flush_broker()
    assert backend.queued_messages() == 0, "the broker lost its messages"
    cluster.sweeper()

    assert run.wait(timeout=60) == {"n": 6, "total": 55, "last": 55 * 55}
    ran = starts(backend, run.id)
    assert all(n == 1 for n in ran.values()), f"a step ran twice: {ran}"
    assert len(ran) == 7


def test_same_run_id_twice_is_one_run(backend: Backend, client: Fleet, cluster: Cluster) -> None:
    first = client.enqueue("chain", 3, run_id="order-42")
    second = client.enqueue("chain", 3, run_id="order-42")
    assert first.id == second.id == "order-42"
    cluster.worker("w1")
    assert first.wait(timeout=60) == 5
    assert len(client.runtime.queries.runs()) == 1
    assert starts(backend, "order-42") == {"work#1": 1, "work#2": 1, "work#3": 1}


def test_a_step_longer_than_its_lease_keeps_it_by_heartbeat(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """Invariant 3: a live step's lease is renewed while it runs, by the worker's
    heartbeat, without the step calling anything; nobody takes it over."""
    cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    cluster.sweeper()
    hold = 3 * backend.lease_seconds
    run = client.enqueue("chain", 2, 0.0, 0, hold)
    assert run.wait(timeout=60) == 0 + 1
    assert starts(backend, run.id) == {"work#1": 1, "work#2": 1}
    assert client.runtime.queries.incident_counts(run.id).get("takeover") is None
    beats = [a for a in client.runtime.queries.attempts(run.id) if a.step_id == "work#1"]
    assert [(a.epoch, a.outcome) for a in beats] == [(1, "done")]
