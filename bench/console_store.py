"""The console's run list at scale (issue 17): ``Browse.runs_page`` over 1,000,000 runs
must cost what a page costs, not what the table costs. Not part of the test suite; it
prints its figures and writes them to ``bench/out/console_store.json``.

    .venv/bin/python -m bench.console_store [--runs 1000000] [--steps 2] [--reps 20] [--keep]

On Postgres, in a database of its own (``fleet_bench_console``, dropped and refilled
unless ``--keep`` finds it filled with as many runs already): the runs are bulk-inserted
with SQL, spread over 30 days of creation times in ties of ten (so keyset paging has
ties to break), over 8 workflows, 200 tenants (one run in five has none) and every
status (one in a thousand waiting), one in twenty a child of the run before it; each
with ``--steps`` task steps and as many attempts. Then each read the console makes is
timed ``--reps`` times in a row: the first page, a deep page (through a cursor 90% of
the way down), each filter, the id search, the fingerprints, the inbox. No worker runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import func, select, text

from bench.common import PG_ADMIN, save
from fleet.store import migrate
from fleet.store.browse import Browse, RunFilter, encode_cursor
from fleet.store.engine import Database
from fleet.store.schema import runs

NAME = "fleet_bench_console"
URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{NAME}"
DAY = 86400.0
STATUSES = "ARRAY['succeeded','succeeded','succeeded','failed','cancelled','running','queued']"

BULK = [
    f"""
    INSERT INTO fleet_runs (id, workflow, version, pins, args, queue, status, result,
        wake_seq, advanced_seq, dispatches, created_at, updated_at, finished_at,
        parent_id, parent_step, detached, tenant)
    SELECT
        CASE WHEN g % 20 = 0 THEN 'run-' || lpad((g - 1)::text, 8, '0') || '/kid#1'
             ELSE 'run-' || lpad(g::text, 8, '0') END,
        'flow_' || (g % 8), '1', '{{}}', '{{"args":[1],"kwargs":{{}}}}', 'fleet',
        CASE WHEN g % 1000 = 7 THEN 'waiting' ELSE ({STATUSES})[1 + g % 7] END,
        NULL, 1, 1, 0,
        now_s - 30 * :day + floor(g / 10) * (30 * :day / (:runs / 10.0)),
        now_s - 30 * :day + floor(g / 10) * (30 * :day / (:runs / 10.0)) + 5,
        NULL,
        CASE WHEN g % 20 = 0 THEN 'run-' || lpad((g - 1)::text, 8, '0') END,
        CASE WHEN g % 20 = 0 THEN 'kid#1' END,
        false,
        CASE WHEN g % 5 = 0 THEN NULL ELSE 'tenant-' || (g % 200) END
    FROM generate_series(1, :runs) AS g,
        (SELECT EXTRACT(EPOCH FROM clock_timestamp()) AS now_s) AS t
    """,
    # A child's tenant is its parent's (g - 1 is never a multiple of 5 when g is of 20).
    """
    UPDATE fleet_runs c SET tenant = p.tenant FROM fleet_runs p
    WHERE c.parent_id = p.id
    """,
    """
    INSERT INTO fleet_steps (run_id, step_id, seq, name, kind, input, status, output,
        attempts, max_attempts, epoch, dispatches, created_at, finished_at)
    SELECT r.id, 'work#' || s, s - 1, 'work', 'task', '{"args":[1],"kwargs":{}}',
        CASE WHEN r.status = 'running' AND s = :steps THEN 'pending' ELSE 'done' END,
        '1', 1, 5, 1, 0, r.created_at, r.created_at + s
    FROM fleet_runs r, generate_series(1, :steps) AS s
    """,
    """
    INSERT INTO fleet_steps (run_id, step_id, seq, name, kind, input, status,
        attempts, max_attempts, epoch, dispatches, created_at, due_at)
    SELECT id, 'wait:approval#1', :steps, 'wait:approval', 'wait', '{}', 'pending',
        0, 1, 0, 0, created_at + 10, created_at + 3 * 86400
    FROM fleet_runs WHERE status = 'waiting'
    """,
    """
    INSERT INTO fleet_attempts (run_id, step_id, epoch, attempt, worker, outcome,
        started_at, finished_at, calls, input_tokens, output_tokens, cost)
    SELECT run_id, step_id, 1, 1, 'bench', 'done', created_at, finished_at, 1, 100, 20, 0.002
    FROM fleet_steps WHERE kind = 'task' AND status = 'done'
    """,
]


def fresh_database() -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{NAME}"')
        conn.execute(f'CREATE DATABASE "{NAME}"')


def filled(db: Database) -> int:
    with db.begin() as conn:
        return int(conn.execute(select(func.count()).select_from(runs)).scalar_one())


def fill(db: Database, n: int, steps: int) -> float:
    """Insert the runs, their steps and attempts; seconds it took (ANALYZE included)."""
    started = time.monotonic()
    with db.begin() as conn:
        for statement in BULK:
            conn.execute(text(statement), {"runs": n, "steps": steps, "day": DAY})
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))
    return time.monotonic() - started


def timed(fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    """Milliseconds per call: median, min, max over ``reps`` calls (one warm-up first)."""
    fn()
    ms = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        ms.append(1000 * (time.perf_counter() - started))
    return {
        "median_ms": round(statistics.median(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
        "n": reps,
    }


def deep_cursor(db: Database, fraction: float) -> str:
    """The cursor of the run ``fraction`` of the way down the unfiltered list."""
    with db.begin() as conn:
        top = int(conn.execute(select(func.count()).where(runs.c.parent_id.is_(None))).scalar())
        row = conn.execute(
            select(runs.c.created_at, runs.c.id)
            .where(runs.c.parent_id.is_(None))
            .order_by(runs.c.created_at.desc(), runs.c.id.desc())
            .offset(int(top * fraction))
            .limit(1)
        ).one()
    return encode_cursor(row.created_at, row.id)


def measure(db: Database, n: int, reps: int) -> dict[str, Any]:
    browse = Browse(db)
    middle = n // 2 + 1 if (n // 2 + 1) % 20 else n // 2 + 2  # a run, not a child
    mid_id = f"run-{middle:08}"
    now = browse.now()
    deep = deep_cursor(db, 0.9)
    second = browse.runs_page().next
    reads: dict[str, Callable[[], Any]] = {
        "first page": lambda: browse.runs_page(),
        "second page (cursor)": lambda: browse.runs_page(after=second),
        "deep page (cursor at 90%)": lambda: browse.runs_page(after=deep),
        "page of 200": lambda: browse.runs_page(limit=200),
        "with children": lambda: browse.runs_page(RunFilter(children=True)),
        "status=succeeded": lambda: browse.runs_page(RunFilter(status="succeeded")),
        "status=waiting (rare)": lambda: browse.runs_page(RunFilter(status="waiting")),
        "status=waiting, deep": lambda: browse.runs_page(RunFilter(status="waiting"), after=deep),
        "workflow=flow_3": lambda: browse.runs_page(RunFilter(workflow="flow_3")),
        "tenant=tenant-42": lambda: browse.runs_page(RunFilter(tenant="tenant-42")),
        "tenant + status": lambda: browse.runs_page(RunFilter(tenant="tenant-42", status="failed")),
        "since 2h": lambda: browse.runs_page(RunFilter(since=now - 7200)),
        "a day, 10 days ago": lambda: browse.runs_page(
            RunFilter(since=now - 11 * DAY, until=now - 10 * DAY)
        ),
        "q=exact id": lambda: browse.runs_page(RunFilter(q=mid_id)),
        f"q=prefix ({mid_id[:8]})": lambda: browse.runs_page(RunFilter(q=mid_id[:8])),
        "runs_fingerprint": lambda: browse.runs_fingerprint(),
        "runs_fingerprint status=running": lambda: browse.runs_fingerprint(
            RunFilter(status="running")
        ),
        "run_fingerprint": lambda: browse.run_fingerprint(mid_id),
        "waiting_on_signal (inbox)": lambda: browse.waiting_on_signal(),
        "queue_names": lambda: browse.queue_names(),
        "workers": lambda: browse.workers(),
        "incidents_by_bucket": lambda: browse.incidents_by_bucket(now - 3600, 300),
    }
    return {name: timed(fn, reps) for name, fn in reads.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=2, help="task steps per run")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="reuse a filled database")
    args = parser.parse_args()
    db = Database(URL) if args.keep else None
    try:
        if db is None or filled(db) != args.runs:
            if db is not None:
                db.dispose()
            fresh_database()
            db = Database(URL)
            migrate.upgrade(db)
            print(f"filling {args.runs} runs ({args.steps} steps each)...", flush=True)
            fill_seconds: float | None = fill(db, args.runs, args.steps)
            print(f"filled in {fill_seconds:.1f}s")
        else:
            fill_seconds = None
            print(f"reusing {NAME}: {args.runs} runs")
        figures = measure(db, args.runs, args.reps)
    finally:
        if db is not None:
            db.dispose()
    width = max(map(len, figures))
    for name, f in figures.items():
        print(f"{name:<{width}}  {f['median_ms']:8.2f} ms  ({f['min_ms']}–{f['max_ms']})")
    result = {"runs": args.runs, "steps_per_run": args.steps, "fill_seconds": fill_seconds}
    print(f"written to {save('console_store', {**result, 'reads': figures})}")


if __name__ == "__main__":
    main()
