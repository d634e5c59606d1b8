"""Invariant 5: side effects at-least-once made effectively-once. The worker dies after
the effect reached a stand-in provider and before the checkpoint; what happens next
depends on what the step declared. Real workers, both backends."""

from __future__ import annotations

import pytest

from fleet import BadInput, Fleet
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, Cluster, poll, starts
from tests.provider import provider_calls

KEY_STEP = "send_{how}#1"


def _crash_after_effect(client: Fleet, cluster: Cluster, how: str) -> str:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    return client.enqueue("notify", how, "hello", True).id


def _calls(backend: Backend, run_id: str, how: str) -> list[dict]:
    key = f"{run_id}:send_{how}#1"
    return [c for c in provider_calls(str(backend.provider_path)) if c["key"] == key]


def test_idempotent_effect_is_retried_with_the_same_key(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    run_id = _crash_after_effect(client, cluster, "idempotent")
    result = client.run(run_id).wait(timeout=60)
    calls = _calls(backend, run_id, "idempotent")
    assert len(calls) == 2 and sum(c["applied"] for c in calls) == 1, "applied once"
    assert result == {"receipt": f"{run_id}:send_idempotent#1", "body": "hello"}
    outcomes = [i.outcome for i in client.runtime.queries.intents(run_id)]
    assert outcomes == ["superseded", "done"]


def test_reconcile_asks_the_world_instead_of_acting_again(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    run_id = _crash_after_effect(client, cluster, "reconciled")
    result = client.run(run_id).wait(timeout=60)
    assert len(_calls(backend, run_id, "reconciled")) == 1, "the body did not run again"
    assert starts(backend, run_id)["send_reconciled#1"] == 1
    assert result == {"receipt": f"{run_id}:send_reconciled#1", "body": "hello"}
    assert [i.outcome for i in client.runtime.queries.intents(run_id)] == ["reconciled"]


@pytest.mark.parametrize("decision", ["output", "retry"])
def test_an_effect_in_doubt_parks_the_run_for_a_person(
    backend: Backend, client: Fleet, cluster: Cluster, decision: str
) -> None:
    run_id = _crash_after_effect(client, cluster, "plain")
    run = client.run(run_id)
    poll(lambda: run.status() == "needs_decision", 60, "the run to need a decision")
    assert len(_calls(backend, run_id, "plain")) == 1, "never retried on a guess"
    status = fleet_cli(backend, "status", run_id)
    assert "in_doubt" in status.stdout and f"{run_id}:send_plain#1" in status.stdout
    runs = fleet_cli(backend, "runs", "--status", "needs_decision")
    assert run_id in runs.stdout
    bad = fleet_cli(backend, "resolve", run_id, "work#1", "--retry")
    assert bad.returncode == 2 and "not an effect in doubt" in bad.stderr

    if decision == "output":
        out = fleet_cli(
            backend, "resolve", run_id, "send_plain#1", "--output", '{"receipt": "checked by hand"}'
        )
        assert out.returncode == 0, out.stderr
        assert run.wait(timeout=60) == {"receipt": "checked by hand"}
        assert len(_calls(backend, run_id, "plain")) == 1
    else:
        out = fleet_cli(backend, "resolve", run_id, "send_plain#1", "--retry")
        assert out.returncode == 0, out.stderr
        result = run.wait(timeout=60)
        calls = _calls(backend, run_id, "plain")
        assert len(calls) == 2, "retried on a person's order, with the same key"
        assert result == {"receipt": f"{run_id}:send_plain#1", "body": "hello"}
    with pytest.raises(BadInput):
        client.resolve(run_id, "send_plain#1", retry=True)


def test_every_effect_attempt_writes_its_intent_first(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("notify", "plain", "hi")
    assert run.wait(timeout=60) == {"receipt": f"{run.id}:send_plain#1", "body": "hi"}
    (intent,) = client.runtime.queries.intents(run.id)
    assert (intent.epoch, intent.outcome) == (1, "done")
    assert intent.idempotency_key == f"{run.id}:send_plain#1"
    assert intent.created_at <= intent.settled_at
