"""A worker paused inside a transaction (SIGSTOP, a GC pause, a VM freeze) keeps its
rows locked until it wakes. The sweeper must pass over those rows, not wait for them:
otherwise one frozen worker stalls the re-sends of every run in the fleet."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from fleet import Fleet
from fleet.worker.replay import advance
from fleet.worker.sweeper import SweepResult, sweep_once
from tests.harness import Backend


def test_a_row_locked_by_a_paused_worker_does_not_stall_the_sweeper(
    backend: Backend, client: Fleet
) -> None:
    if backend.kind == "sqlite":
        pytest.skip("SQLite locks the whole file: there is no row to pass over")
    rt = client.runtime
    for rid in ("paused", "other"):
        client.enqueue("chain", 1, run_id=rid)
        advance(rt, rid)  # records each run's first step
    lease = rt.ledger.take_lease("paused", "work#1", "worker-a", 0.2)
    assert lease is not None
    # Both steps due for a re-send as soon as the paused one's lease has expired.
    with rt.db.begin() as conn:
        conn.exec_driver_sql("UPDATE fleet_steps SET redispatch_at = NULL")
    libpq_url = backend.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(libpq_url) as paused:
        # The paused worker: a lease renewal's UPDATE, never committed.
        paused.execute(
            "UPDATE fleet_steps SET lease_expires_at = lease_expires_at "
            "WHERE run_id = 'paused' AND step_id = 'work#1'"
        )
        deadline = time.monotonic() + 10
        while rt.queries.step("paused", "work#1").lease_expires_at > time.time():
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.05)
        result: list[SweepResult] = []
        sweeper = threading.Thread(target=lambda: result.append(sweep_once(rt)), daemon=True)
        sweeper.start()
        sweeper.join(10)
        stalled = sweeper.is_alive()
        paused.rollback()
    sweeper.join(10)
    assert not stalled, "the sweeper waited for the paused worker's lock"
    assert result and result[0].steps == 1, "the other run's step was re-sent"
