"""Invariant 8: JSON only, bounded, no secrets. Real workers, both backends."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from fleet import Fleet, PayloadError, RunFailed, Secret
from fleet.store.schema import blobs
from tests.harness import Backend, Cluster, everything_in_the_store

SECRET = "s3cr3t-value-that-must-not-leak"
MIB = 1024 * 1024


def test_a_large_output_round_trips_by_reference(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("large", MIB)
    assert run.wait(timeout=60) == {"len": MIB, "same": True}
    outputs = {s.step_id: s.output for s in client.runtime.queries.steps(run.id)}
    assert outputs["big#1"] == outputs["big#2"] and outputs["big#1"].startswith("blob:")
    with client.runtime.db.begin() as conn:
        rows = conn.execute(select(blobs.c.digest, blobs.c.size)).all()
    assert len(rows) == 1, "stored once, referenced twice"
    assert rows[0].size == MIB + 2  # the JSON string, quotes included


def test_a_secret_is_used_by_the_step_and_written_nowhere(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    backend.extra_env["FLEET_TEST_SECRET"] = SECRET
    worker = cluster.worker("w1")
    run = client.enqueue("secretive")
    assert run.wait(timeout=60) == {
        "length": len(SECRET),
        "repr": "Secret.env('FLEET_TEST_SECRET')",
    }
    leaky = client.enqueue("secretive", True)
    with pytest.raises(RunFailed, match="holds a Secret with a literal value"):
        leaky.wait(timeout=60)
    assert SECRET not in everything_in_the_store(client)
    assert SECRET not in worker.output(), "nor in the worker's logs"
    (letter,) = client.dead_letters(run_id=leaky.id)
    assert letter.error_type == "PayloadError" and letter.attempts == 1


def test_a_literal_secret_is_refused_before_anything_is_recorded(client: Fleet) -> None:
    with pytest.raises(PayloadError, match="Secret with a literal value"):
        client.enqueue("secretive", Secret(SECRET))
    assert client.runtime.queries.runs() == []
    assert SECRET not in repr(Secret(SECRET)) and SECRET not in str(Secret(SECRET))
