"""``async def`` steps on the worker process's one event loop (issue #20): everything a
sync step has holds while one awaits. Results, retries and refusals; a worker killed or
frozen mid-await; a cancelled run's coroutine cancelled at once; an async effect killed
after its call; one loop per process. Real workers, both backends."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from fleet import Fleet, RunFailed
from fleet.testing import FleetProcess
from tests.harness import Backend, Cluster, executions, find_event, poll, starts
from tests.provider import provider_calls


def _loops(backend: Backend, run_id: str) -> set[str]:
    return {e["loop"] for e in executions(backend, run_id) if "loop" in e}


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_an_async_step_s_result_reaches_the_workflow(
    backend: Backend, client: Fleet, cluster: Cluster, pool: str
) -> None:
    cluster.worker("w1", concurrency=2, pool=pool)
    run = client.enqueue("async_chain", 3)
    assert run.wait(timeout=60) == 0 + 1 + 4
    assert starts(backend, run.id) == {
        "work#1": 1,
        "anap#1": 1,
        "anap#2": 1,
        "anap#3": 1,
        "other#1": 1,
    }
    assert len(_loops(backend, run.id)) == 1, "every async step on the process's one loop"
    # work(0) records 10 tokens, anap(i) 10 + i, the async ones through arecord_usage.
    assert run.usage()["tokens"] == 10 + sum(10 + i for i in range(3))


def test_retry_and_non_retryable_from_an_async_step_behave_as_from_a_sync_one(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.sweeper()
    run = client.enqueue("async_policy", 2, "bad input")
    out = run.wait(timeout=60)
    assert out["took"] == 3, "two retries asked for, then the third attempt returned"
    assert out["refused"].endswith("NonRetryable: bad input")
    assert starts(backend, run.id) == {"aflaky#1": 3, "arefuse#1": 1}, "refused: no retry"
    (letter,) = client.dead_letters(run.id)
    assert (letter.step_id, letter.error, letter.attempts) == (
        "arefuse#1",
        "NonRetryable: bad input",
        1,
    )
    attempts = client.runtime.queries.attempts(run.id)
    assert [a.outcome for a in attempts if a.step_id == "aflaky#1"] == ["failed", "failed", "done"]


def test_a_sync_step_returning_a_coroutine_is_dead_lettered_in_one_line(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("async_wrapped")
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=60)
    (letter,) = client.dead_letters(run.id)
    assert letter.error == (
        "NonRetryable: step 'wrapped_fetch' returned a coroutine: declare it `async def`"
    )
    assert letter.attempts == 1
    assert "JSON" not in str(failed.value) and "\n" not in str(failed.value)
    assert not find_event(backend, run.id, "wrapped_fetch#1", "start"), "never awaited"


def test_sigkill_while_an_async_step_awaits_runs_it_again_once(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    run = client.enqueue("async_chain", 4, 2, 60.0)  # anap#3 awaits 60 s on attempt 1
    victim = poll(
        lambda: find_event(backend, run.id, "anap#3", "start", attempt=1), 30, "anap#3 to start"
    )
    cluster.by_pid(victim["pid"]).signal(signal.SIGKILL)

    assert run.wait(timeout=60) == 0 + 1 + 4 + 9
    assert starts(backend, run.id) == {
        "work#1": 1,
        "anap#1": 1,
        "anap#2": 1,
        "anap#3": 2,
        "anap#4": 1,
        "other#1": 1,
    }, "the killed step ran again once; the earlier ones not at all"
    step = client.runtime.queries.step(run.id, "anap#3")
    assert step is not None and (step.attempts, step.epoch) == (2, 2)
    again = find_event(backend, run.id, "anap#3", "start", attempt=2)
    assert again is not None and again["pid"] != victim["pid"]


def test_a_frozen_worker_s_async_commit_is_fenced_when_it_wakes(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    # alinger#1's first attempt awaits 3 s against a 2 s lease; the takeover awaits 5 s,
    # so the zombie, woken as the takeover starts, ends while epoch 2 holds the step.
    run = client.enqueue("async_frozen", 3.0, 5.0)
    first = poll(
        lambda: find_event(backend, run.id, "alinger#1", "start", attempt=1),
        30,
        "alinger#1 to start",
    )
    zombie = cluster.by_pid(first["pid"])
    zombie.signal(signal.SIGSTOP)
    poll(
        lambda: find_event(backend, run.id, "alinger#1", "start", epoch=2),
        30,
        "another worker to take alinger#1 over at epoch 2",
    )
    zombie.signal(signal.SIGCONT)

    assert run.wait(timeout=60) == 2, "the workflow saw the epoch-2 attempt's output"
    # Awake, the zombie either finished its await (its commit fenced) or its heartbeat
    # found the lease lost first (its task cancelled, its retry fenced): fenced both ways.
    woke = find_event(backend, run.id, "alinger#1", "end", epoch=1) or find_event(
        backend, run.id, "alinger#1", "cancelled", epoch=1
    )
    assert woke is not None and woke["pid"] == first["pid"]
    q = client.runtime.queries
    outcomes = {a.epoch: a.outcome for a in q.attempts(run.id) if a.step_id == "alinger#1"}
    assert outcomes == {1: "fenced", 2: "done"}
    step = q.step(run.id, "alinger#1")
    assert step is not None and step.epoch == 2 and step.output == '{"epoch":2}'
    assert q.incident_counts(run.id).get("fenced_write") == 1


# A 2 s lease is renewed every 0.67 s; the default 30 s one every 10 s, but the worker
# looks for revoked leases of its awaiting steps every second between renewals.
@pytest.mark.parametrize(("lease", "bound"), [(2.0, 1.0), (30.0, 2.5)])
def test_cancelling_a_run_cancels_its_awaiting_coroutine_within_a_second(
    backend: Backend, client: Fleet, cluster: Cluster, lease: float, bound: float
) -> None:
    backend.lease_seconds = lease
    cluster.worker("w1")
    cluster.sweeper()
    run = client.enqueue("async_chain", 2, 0, 60.0)  # anap#1 awaits 60 s on attempt 1
    poll(lambda: find_event(backend, run.id, "anap#1", "start"), 30, "anap#1 to start")
    cancelled_at = time.time()
    assert client.cancel(run.id, "no longer needed")

    seen = poll(
        lambda: find_event(backend, run.id, "anap#1", "cancelled"), 10, "the coroutine's cancel"
    )
    took = seen["t"] - cancelled_at
    assert took < bound, f"the coroutine was cancelled {took:.2f} s after the run (lease {lease})"
    q = client.runtime.queries
    # The attempt ends as a sync one that lost its lease: its write fenced, nothing kept.
    poll(
        lambda: {a.outcome for a in q.attempts(run.id) if a.step_id == "anap#1"} == {"fenced"},
        10,
        "the cancelled attempt to report itself fenced",
    )
    step = q.step(run.id, "anap#1")
    assert step is not None and step.status != "done" and step.output is None
    assert run.status() == "cancelled"
    assert not find_event(backend, run.id, "anap#1", "end")
    assert set(starts(backend, run.id)) == {"work#1", "anap#1"}, "nothing ran after"


def _calls(backend: Backend, run_id: str, how: str) -> list[dict[str, Any]]:
    key = f"{run_id}:asend_{how}#1"
    return [c for c in provider_calls(str(backend.provider_path)) if c["key"] == key]


@pytest.mark.parametrize("how", ["idempotent", "reconciled"])
def test_an_async_effect_killed_after_its_call_applies_once(
    backend: Backend, client: Fleet, cluster: Cluster, how: str
) -> None:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    run = client.enqueue("async_notify", how, "hello", True)
    result = run.wait(timeout=60)
    assert result == {"receipt": f"{run.id}:asend_{how}#1", "body": "hello"}
    calls = _calls(backend, run.id, how)
    assert sum(c["applied"] for c in calls) == 1, f"applied once: {calls}"
    outcomes = [i.outcome for i in client.runtime.queries.intents(run.id)]
    if how == "idempotent":
        assert len(calls) == 2 and outcomes == ["superseded", "done"]
    else:  # the async reconcile hook found it done: the body did not run again
        assert len(calls) == 1 and outcomes == ["reconciled"]
        assert starts(backend, run.id)[f"asend_{how}#1"] == 1
        assert find_event(backend, run.id, f"asend_{how}#1", "reconcile", attempt=2)


def test_two_async_steps_in_one_process_share_one_loop_and_await_together(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=4)
    run = client.enqueue("async_pair", 1.0)
    first, second = run.wait(timeout=60)
    assert first == second, "one loop for the process's slots"
    events = executions(backend, run.id)
    began = [e["t"] for e in events if e["event"] == "start"]
    ended = [e["t"] for e in events if e["event"] == "end"]
    assert len(began) == 2 and max(began) < min(ended), "both awaited at once"


def test_an_async_step_on_a_gevent_worker_is_refused_in_one_line(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    pytest.importorskip("gevent")
    cluster.worker("green", concurrency=4, pool="gevent")
    run = client.enqueue("async_chain", 1)
    with pytest.raises(RunFailed):
        run.wait(timeout=60)
    (letter,) = client.dead_letters(run.id)
    assert letter.step_id == "anap#1" and letter.attempts == 1
    assert letter.error == (
        "NonRetryable: step 'anap' is `async def`, which a gevent pool cannot run: "
        "run its worker with --pool threads or prefork"
    )


# --- misbehaving async steps (issue 48, item 11) -----------------------------------------


def _lines(worker: FleetProcess, *parts: str) -> list[str]:
    return [line for line in worker.output().splitlines() if all(p in line for p in parts)]


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_step_blocking_the_loop_is_named_in_one_warning_line(
    backend: Backend, client: Fleet, cluster: Cluster, pool: str
) -> None:
    worker = cluster.worker("w1", concurrency=2, pool=pool)
    run = client.enqueue("async_blocking", 3.0)
    assert run.wait(timeout=60) == "ablock#1"
    held = _lines(worker, "event loop held over 1.0s")
    assert len(held) == 1, worker.output()[-3000:]
    assert f"by step ablock#1 of run {run.id}: an `async def` step must not block" in held[0]
    assert "WARNING" in held[0]


# The worker's one slot (threads with every async attempt on its slot, or prefork) or its
# one place off the slots (FLEET_ASYNC_AWAITING=1): a coroutine that swallows its cancel
# must not keep it.
@pytest.mark.parametrize(
    ("pool", "awaiting"), [("threads", "0"), ("prefork", ""), ("threads", "1")]
)
def test_a_step_swallowing_its_cancel_is_logged_and_gives_its_slot_back(
    backend: Backend, client: Fleet, cluster: Cluster, pool: str, awaiting: str
) -> None:
    if awaiting:
        backend.extra_env["FLEET_ASYNC_AWAITING"] = awaiting
    worker = cluster.worker("w1", concurrency=1, pool=pool)
    cluster.sweeper()
    stuck = client.enqueue("async_swallowing")
    poll(lambda: find_event(backend, stuck.id, "aswallow#1", "start"), 30, "aswallow to start")
    assert client.cancel(stuck.id, "no longer needed")
    poll(lambda: find_event(backend, stuck.id, "aswallow#1", "swallowed"), 10, "the cancel")

    later = client.enqueue("async_chain", 2)
    assert later.wait(timeout=60) == 0 + 1, "a later async step still got a slot"
    name = f"step aswallow#1 of run {stuck.id}"
    poll(lambda: _lines(worker, name, "swallowed"), 15, "the line saying it swallowed it")
    lines = _lines(worker, name)
    swallowed = [line for line in lines if "swallowed the CancelledError" in line]
    assert len(swallowed) == 1, worker.output()[-3000:]
    assert "did not end within 5s of being cancelled" in swallowed[0]
    assert not [line for line in lines if "lost its lease while awaiting" in line], "one line"
    assert stuck.status() == "cancelled"
    worker.stop()  # a warm shutdown: nothing left off the slots to wait for
    assert "async attempt(s) off the slots" not in worker.output()
