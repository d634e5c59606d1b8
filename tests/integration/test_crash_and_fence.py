"""Invariants 1 and 3 under fire: real workers killed, frozen, and messages duplicated
or wiped, on both backends."""

from __future__ import annotations

import signal

from fleet import Fleet
from fleet.replay import advance, step_shadow
from tests.harness import Backend, Cluster, find_event, poll, starts

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


def test_frozen_worker_is_fenced_when_it_wakes(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    # work#2's first attempt holds for 6 s; the lease is 2 s.
    run = client.enqueue("chain", 3, 0.0, 1, 6.0)
    first = poll(
        lambda: find_event(backend, run.id, "work#2", "start", attempt=1), 30, "work#2 to start"
    )
    zombie = cluster.by_pid(first["pid"])
    zombie.signal(signal.SIGSTOP)
    poll(
        lambda: find_event(backend, run.id, "work#2", "end", epoch=2),
        30,
        "the takeover attempt (epoch 2) to finish work#2",
    )
    zombie.signal(signal.SIGCONT)

    assert run.wait(timeout=60) == 0 + 1 + 4
    q = client.runtime.queries

    def zombie_outcome() -> str | None:
        rows = [a for a in q.attempts(run.id) if a.step_id == "work#2" and a.epoch == 1]
        return rows[0].outcome if rows and rows[0].outcome == "fenced" else None

    poll(zombie_outcome, 30, "the zombie's commit to be rejected")
    assert find_event(backend, run.id, "work#2", "end", epoch=1), "the zombie did finish its work"
    step = q.step(run.id, "work#2")
    assert step is not None and step.epoch == 2
    assert '"epoch":2' in step.output, "the recorded output is the epoch-2 attempt's"
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
