"""Retention under load (issue 13): pruning 100,000 finished runs must not block a
running fleet. Not part of the test suite; it prints its figures and writes them to
``bench/out/prune.json``.

    .venv/bin/python -m bench.prune [--runs 100000] [--steps 5] [--batch 200]

On Postgres + Redis: the finished runs are bulk-inserted with SQL (each with ``--steps``
done steps and as many attempts, and an incident for one run in ten), all finished two
days ago. A worker (threads, concurrency 4) then runs a live workload: a feeder keeps
eight ``chain`` runs of 20 steps in flight, so step checkpoints commit continuously.
After a warm-up, the step commits of a ``--baseline`` window are measured, then
``Fleet.prune(1 day)`` runs in this process while the workload goes on, then a short
window after it. Every figure comes from the store: each live step's ``finished_at`` is
its commit time on the database's clock, so the longest gap between consecutive commits
is the longest time the fleet committed nothing (the stall a prune batch could cause).
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from sqlalchemy import select, text

from bench.common import Services, processes, save, services, wait_until
from fleet import Fleet, Settings
from fleet.store.schema import steps
from fleet.testing import WORKER_READY, worker_argv

APP = "tests.flows"
REDIS_DB = 13
IN_FLIGHT, CHAIN = 8, 20
DAY = 86400.0

# One statement per table: runs, their done steps and attempts, and an incident for one
# run in ten; everything finished :finished seconds before now on the store's clock.
BULK = [
    """
    INSERT INTO fleet_runs (id, workflow, version, pins, args, queue, status, result,
        wake_seq, advanced_seq, dispatches, created_at, updated_at, finished_at)
    SELECT 'old-' || lpad(g::text, 7, '0'), 'chain', '1', '{}',
        '{"args":[5],"kwargs":{}}', 'fleet.chain.v1',
        (ARRAY['succeeded','failed','cancelled'])[1 + g % 3], '30', 1, 1, 0,
        now_s - :finished - 60, now_s - :finished, now_s - :finished
    FROM generate_series(1, :runs) AS g,
        (SELECT EXTRACT(EPOCH FROM clock_timestamp()) AS now_s) AS t
    """,
    """
    INSERT INTO fleet_steps (run_id, step_id, seq, name, kind, input, status, output,
        attempts, max_attempts, epoch, dispatches, created_at, finished_at)
    SELECT r.id, 'work#' || s, s - 1, 'work', 'task', '{"args":[1],"kwargs":{}}', 'done',
        '{"i": 1, "value": 1, "epoch": 1}', 1, 5, 1, 0, r.created_at, r.finished_at
    FROM fleet_runs r, generate_series(1, :steps) AS s WHERE r.id LIKE 'old-%'
    """,
    """
    INSERT INTO fleet_attempts (run_id, step_id, epoch, attempt, worker, outcome,
        started_at, finished_at, calls, input_tokens, output_tokens, cost)
    SELECT run_id, step_id, 1, 1, 'bench', 'done', created_at, finished_at, 1, 10, 1, 0.001
    FROM fleet_steps WHERE run_id LIKE 'old-%'
    """,
    """
    INSERT INTO fleet_incidents (kind, run_id, step_id, epoch, worker, at)
    SELECT 'duplicate_delivery', id, 'work#1', 1, 'bench', finished_at
    FROM fleet_runs WHERE id LIKE 'old-%' AND right(id, 1) = '0'
    """,
]


def bulk_insert(client: Fleet, runs: int, steps_per_run: int) -> float:
    """Insert the finished runs; seconds it took."""
    started = time.monotonic()
    with client.runtime.db.begin() as conn:
        for statement in BULK:
            conn.execute(
                text(statement), {"runs": runs, "steps": steps_per_run, "finished": 2 * DAY}
            )
    with client.runtime.db.begin() as conn:
        conn.execute(text("ANALYZE"))
    return time.monotonic() - started


class Feeder(threading.Thread):
    """Keeps ``IN_FLIGHT`` live runs going until stopped."""

    def __init__(self, client: Fleet) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.stop = threading.Event()
        self.enqueued = 0

    def run(self) -> None:
        live: list[Any] = []
        while not self.stop.is_set():
            live = [r for r in live if r.status() not in ("succeeded", "failed", "cancelled")]
            while len(live) < IN_FLIGHT:
                live.append(self.client.enqueue("chain", CHAIN))
                self.enqueued += 1
            self.stop.wait(0.2)


def commits(client: Fleet, since: float, until: float) -> list[float]:
    """Commit times (store clock) of the live workload's steps within [since, until]."""
    with client.runtime.db.begin() as conn:
        return sorted(
            conn.execute(
                select(steps.c.finished_at).where(
                    steps.c.finished_at >= since,
                    steps.c.finished_at <= until,
                    ~steps.c.run_id.like("old-%"),
                )
            ).scalars()
        )


def window(client: Fleet, since: float, until: float) -> dict[str, float]:
    """Steps per second and the longest gap between commits (edges included)."""
    times = commits(client, since, until)
    edges = [since, *times, until]
    gaps = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    return {
        "seconds": round(until - since, 2),
        "steps": len(times),
        "steps_per_s": round(len(times) / (until - since), 1),
        "longest_gap_ms": round(1000 * max(gaps), 1),
    }


def measure(
    svc: Services, runs: int, steps_per_run: int, batch: int, baseline: float
) -> dict[str, Any]:
    from tests import flows

    client = flows.fleet.with_settings(Settings.from_env(svc.env()))
    client.upgrade_schema()
    inserted_in = bulk_insert(client, runs, steps_per_run)
    print(f"inserted {runs} finished runs ({runs * steps_per_run} steps) in {inserted_in:.1f}s")
    argv = [("w1", worker_argv(APP, 4, "threads"))]
    with processes(svc, argv, WORKER_READY, FLEET_TEST_LOG=str(svc.workdir / "steps.jsonl")):
        feeder = Feeder(client)
        feeder.start()
        now = client.runtime.queries.now
        wait_until(lambda: len(commits(client, now() - 2, now())) > 20, 60, "the workload")
        time.sleep(2.0)  # warm-up: caches, connections
        before_start = now()
        time.sleep(baseline)
        before_end = now()
        started = time.monotonic()
        result = client.prune(DAY, batch=batch)
        prune_seconds = time.monotonic() - started
        during_end = now()
        time.sleep(3.0)
        after_end = now()
        feeder.stop.set()
        feeder.join(timeout=10)
    return {
        "runs": runs,
        "steps_per_run": steps_per_run,
        "batch": batch,
        "pruned": result.counts(),
        "prune_seconds": round(prune_seconds, 2),
        "runs_pruned_per_s": round(result.runs / prune_seconds, 1),
        "before": window(client, before_start, before_end),
        "during": window(client, before_end, during_end),
        "after": window(client, during_end, after_end),
        "live_runs_enqueued": feeder.enqueued,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=5, help="done steps per finished run")
    parser.add_argument("--batch", type=int, default=200, help="runs per prune transaction")
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds measured before")
    args = parser.parse_args()
    with services("prune", redis_db=REDIS_DB) as svc:
        figures = measure(svc, args.runs, args.steps, args.batch, args.baseline)
    before, during = figures["before"], figures["during"]
    print(
        f"pruned {figures['pruned']['runs']} runs ({figures['pruned']['steps']} steps, "
        f"{figures['pruned']['attempts']} attempts, {figures['pruned']['incidents']} incidents)"
        f" in {figures['prune_seconds']}s: {figures['runs_pruned_per_s']} runs/s"
    )
    for name in ("before", "during", "after"):
        w = figures[name]
        print(
            f"{name:>6}: {w['steps_per_s']} steps/s over {w['seconds']}s, "
            f"longest commit gap {w['longest_gap_ms']} ms"
        )
    print(f"steps/s during pruning: {during['steps_per_s'] / before['steps_per_s']:.0%} of before")
    print(f"written to {save('prune', figures)}")


if __name__ == "__main__":
    main()
