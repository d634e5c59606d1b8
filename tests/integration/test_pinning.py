"""Invariant 9: a run is pinned to its workflow version and pins. A worker that has
another version never advances it; the mismatch is visible, not silent."""

from __future__ import annotations

from fleet import Fleet
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, Cluster, poll, starts


def test_a_v2_worker_leaves_a_v1_run_to_a_v1_worker(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    from tests import flows_v2

    v2_client = flows_v2.fleet.with_settings(backend.settings())
    old = client.enqueue("pinned", "old")
    assert client.runtime.queries.run(old.id).queue.startswith("fleet.pinned.v1-")

    cluster.worker("v2", app="tests.flows_v2")
    new = v2_client.enqueue("pinned", "new")
    assert new.wait(timeout=60) == "new by v2"
    # Even handed the old run's wake-up directly, the v2 worker leaves it alone.
    client.runtime.dispatcher.advance(old.id, "fleet")
    poll(
        lambda: client.runtime.queries.incident_counts(old.id).get("version_mismatch"),
        30,
        "the v2 worker to refuse the v1 run",
    )
    assert old.status() == "queued" and starts(backend, old.id) == {}
    status = fleet_cli(backend, "status", old.id)
    assert "waits for" in status.stdout and "version 1" in status.stdout

    cluster.worker("v1")  # the old version, deployed beside the new one, drains its runs
    assert old.wait(timeout=60) == "old by v1"


def test_changing_a_pinned_value_is_a_new_queue() -> None:
    from fleet.registry import WorkflowDef

    def fn(wf: object) -> None:
        return None

    a = WorkflowDef("w", fn, "1", {"model": "m-2026-10"})
    b = WorkflowDef("w", fn, "1", {"model": "m-2026-11"})
    assert a.queue("fleet") != b.queue("fleet")
    assert not b.pinned_to("1", {"model": "m-2026-10"})


def test_a_v2_worker_does_not_execute_a_v1_step(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:

    from fleet.worker.replay import advance, step_shadow

    old = client.enqueue("pinned", "old")
    advance(client.runtime, old.id)  # v1 records stamp#1 and sends it to its own queue
    cluster.worker("v2", app="tests.flows_v2")
    client.runtime.dispatcher.execute(
        old.id, "stamp#1", "fleet", shadow=step_shadow("pinned", "stamp#1")
    )
    poll(
        lambda: client.runtime.queries.incident_counts(old.id).get("version_mismatch"),
        30,
        "the v2 worker to refuse the v1 step",
    )
    assert starts(backend, old.id) == {}
    cluster.worker("v1")
    assert old.wait(timeout=60) == "old by v1"
