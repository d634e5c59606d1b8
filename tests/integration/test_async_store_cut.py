"""Async steps on the loop's own thread (``fleet/worker/on_loop.py``) keep their store
round trips in flight on the loop, parked on the sockets (``fleet/store/waits.py``).
Here Postgres cuts every connection of the worker again and again while runs of async
steps go through it: each run still ends with its one right result, the worker stays
up, and it serves a run enqueued after the cuts; each failure is said in one line
naming its step. Real Postgres, real worker; Postgres only (SQLite's attempts never
wait on the loop)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from fleet import Fleet
from tests.harness import Backend, Cluster

TAG = "fleet-cut-me"  # the worker's connections' application_name: only those are cut

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)

RUNS = 32
STEPS = 8
RESULT = sum(i * i for i in range(STEPS))  # ``async_chain``: the sum of the squares
# How long Postgres keeps cutting. A cut loses the attempts whose transactions it
# reaches, and the sweeper takes each up again once its lease (the harness's 2 s) has
# lapsed, so in this window no step loses more than two attempts of its three (``work``
# and ``other``; ``anap`` has five). Cutting until every run had ended instead lost a
# step's every attempt when the host was loaded (three copies at once).
CUT_FOR = 4.0
# Once a cut has reached a transaction in flight, cutting goes on this long only: a
# store error inside a step is a failed attempt retried within 0.1-1 s, so a longer
# window could spend a step's five attempts on a loaded host (CI, 3 test processes on
# two cores): correct, but not what this test is about.
AFTER_FIRST = 1.0
BATCHES = 3


def _cut_the_worker_s_connections(conn: Any) -> int:
    """Terminate every backend the worker has open; how many of them were in a
    transaction (a statement running, or one open between two round trips)."""
    cut = conn.execute(
        text(
            "SELECT state, pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = :tag"
        ),
        {"tag": TAG},
    ).all()
    return sum(1 for state, done in cut if done and state and state != "idle")


def test_async_steps_go_on_when_postgres_cuts_their_connections(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    url = backend.database_url
    cluster.sweeper()  # on untagged connections: only the worker's are cut
    backend.extra_env["FLEET_DATABASE_URL"] = f"{url}?application_name={TAG}"
    worker = cluster.worker("w1", concurrency=2)
    runs: list[Any] = []
    in_flight = 0
    killer = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with killer.connect() as conn:
            # A batch of runs, cut while they go through (their round trips parked on
            # the loop); another batch, at most twice more, while no cut has reached a
            # transaction in flight (the runs of a batch may all end between two cuts).
            for _ in range(BATCHES):
                batch = [client.enqueue("async_chain", STEPS) for _ in range(RUNS)]
                runs += batch
                deadline = time.monotonic() + CUT_FOR
                while time.monotonic() < deadline:
                    if all(r.status() in ("succeeded", "failed") for r in batch):
                        break
                    reached = _cut_the_worker_s_connections(conn)
                    if reached and not in_flight:  # proved: cut on a little, then stop
                        deadline = min(deadline, time.monotonic() + AFTER_FIRST)
                    in_flight += reached
                    time.sleep(0.05)
                if in_flight:
                    break
    finally:
        killer.dispose()
    assert in_flight > 0, "no cut reached a transaction in flight: the test proved nothing"
    out = worker.output()
    # A store failure off the slots is said as on them: one line naming the step, not a
    # traceback of an attempt "failed outside its step".
    assert "failed outside its step" not in out
    for run in runs:
        assert run.wait(timeout=90) == RESULT, f"run {run.id}"
    assert worker.alive, f"the worker died:\n{worker.output()}"
    after = client.enqueue("async_chain", 2)
    assert after.wait(timeout=30) == 0 + 1, "the worker serves runs after the cuts"
    assert worker.alive, f"the worker died:\n{worker.output()}"
