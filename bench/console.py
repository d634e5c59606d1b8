"""The console's pages at scale (issue 17, "Measures"): the runs page and a 1,000-step
run's page each render in under 200 ms server time with 1,000,000 runs in Postgres; an
open run page costs the store at most one query per second however many browsers
watch it. Not part of the test suite; it prints its figures and writes them to
``bench/out/console.json``.

    .venv/bin/python -m bench.console [--runs 1000000] [--reps 20] [--keep] [--watch 6]

The runs are ``bench.console_store``'s fill (database ``fleet_bench_console``, reused
with ``--keep`` when it holds as many). Beside them this adds, and removes again at
the end (so ``console_store --keep`` still finds its fill): one failed run of 1,000
task steps (one in ten retried, one fenced write, one lost lease, the last step dead
with three failed attempts, one output in fifty over 2 KB), its dead letter and
``--letters`` more on other runs, a few incidents in the last hour and audit rows.

Pages: each is requested in process through the ASGI app (httpx's ``ASGITransport``,
no network, no auth), one warm-up then ``--reps`` times: milliseconds (median, p95,
max) and the statements the store received per request. Watchers: K concurrent
``/events/run`` streams on the long run for ``--watch`` seconds, counting every
statement the Fleet's engine sends (a ``before_cursor_execute`` listener), idle and
while the run's row changes twice a second from another connection.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode

import httpx
import psycopg
from sqlalchemy import event, text

from bench.common import percentile, save
from bench.console_store import NAME, URL, deep_cursor, fill, filled, fresh_database
from fleet import Fleet
from fleet.console import app as console_app
from fleet.errors import StoreUnavailable
from fleet.store import migrate
from fleet.store.engine import Database

LONG = "bench-long-run"
STEPS = 1000
STEADY = 2.0  # seconds into a watch from which the streams count as settled
BROKER = "redis://127.0.0.1:6379/3"
NAMES = "ARRAY['search','read','summarize','call_model']"
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "tasks/agent.py", line 42, in call_model\n'
    "    raise RuntimeError('upstream 503')\n"
    "RuntimeError: upstream 503"
)

EXTRA = [
    """
    INSERT INTO fleet_runs (id, workflow, version, pins, args, queue, status, error,
        wake_seq, advanced_seq, dispatches, created_at, updated_at, finished_at, detached,
        tenant)
    SELECT :run, 'flow_long', '1', '{}', '{"args":["a long task"],"kwargs":{}}',
        'fleet', 'failed', :tb, 1, 1, 0, t - 3600, t - 60, t - 60, false,
        'tenant-7'
    FROM (SELECT EXTRACT(EPOCH FROM clock_timestamp()) AS t) AS now
    """,
    f"""
    INSERT INTO fleet_steps (run_id, step_id, seq, name, kind, input, status, output,
        error, attempts, max_attempts, epoch, dispatches, created_at, finished_at)
    SELECT r.id, ({NAMES})[1 + s % 4] || '#' || (s / 4 + 1), s, ({NAMES})[1 + s % 4],
        'task', '{{"args":["item ' || s || '"],"kwargs":{{}}}}',
        CASE WHEN s = :last THEN 'dead' ELSE 'done' END,
        CASE WHEN s = :last THEN NULL
             WHEN s % 50 = 0 THEN '{{"text":"' || repeat('lorem ipsum ', 200) || '"}}'
             ELSE '{{"text":"result ' || s || '","n":' || s || '}}' END,
        CASE WHEN s = :last THEN :tb END,
        CASE WHEN s = :last THEN 3 WHEN s % 10 = 3 THEN 2 ELSE 1 END, 3,
        CASE WHEN s = :last THEN 3 WHEN s % 10 = 3 THEN 2 ELSE 1 END, 0,
        r.created_at + s * 3, r.created_at + s * 3 + 2.5
    FROM fleet_runs r, generate_series(0, :last) AS s WHERE r.id = CAST(:run AS varchar)
    """,
    """
    INSERT INTO fleet_attempts (run_id, step_id, epoch, attempt, worker, outcome, error,
        started_at, finished_at, model, calls, input_tokens, output_tokens, cost)
    SELECT run_id, step_id, a, a, 'worker-' || ((seq + a) % 3),
        CASE WHEN seq = 513 AND a = 1 THEN 'fenced'
             WHEN seq = 523 AND a = 1 THEN 'lost'
             WHEN a < attempts OR status = 'dead' THEN 'failed' ELSE 'done' END,
        CASE WHEN a < attempts OR status = 'dead' THEN 'TimeoutError: read timed out' END,
        created_at + (a - 1) * 0.8, created_at + a * 0.8, 'gpt-bench', 1, 800, 200, 0.003
    FROM fleet_steps, generate_series(1, attempts) AS a WHERE run_id = :run
    """,
    """
    INSERT INTO fleet_dead_letters (run_id, step_id, workflow, name, input, error_type,
        error_message, traceback, attempts, first_failed_at, last_failed_at)
    SELECT run_id, step_id, 'flow_long', name, input, 'RuntimeError', 'upstream 503',
        :tb, 3, created_at, finished_at
    FROM fleet_steps WHERE run_id = :run AND status = 'dead'
    """,
    # More letters on other runs (the list page reads them all), one in four replayed.
    """
    INSERT INTO fleet_dead_letters (run_id, step_id, workflow, name, input, error_type,
        error_message, traceback, attempts, first_failed_at, last_failed_at, replayed_at)
    SELECT r.id, 'work#1', r.workflow, 'work', '{"args":[1],"kwargs":{}}',
        'ValueError', 'bad row ' || g, :tb, 5, r.created_at, r.created_at + 9,
        CASE WHEN g % 4 = 0 THEN r.created_at + 60 END
    FROM generate_series(1, :letters) AS g
    JOIN fleet_runs r ON r.id = 'run-' || lpad((g * 7 + 1)::text, 8, '0')
    """,
    """
    INSERT INTO fleet_incidents (kind, run_id, step_id, epoch, worker, detail, at)
    SELECT (ARRAY['fenced_write','duplicate_delivery','takeover'])[1 + g % 3], :run,
        'read#1', 1, 'worker-1', 'bench', EXTRACT(EPOCH FROM clock_timestamp()) - g * 97
    FROM generate_series(1, 30) AS g
    """,
    """
    INSERT INTO fleet_audit (at, actor, action, run_id, target, why, detail)
    SELECT EXTRACT(EPOCH FROM clock_timestamp()) - g * 60, 'ada',
        (ARRAY['signal','resolve','raise_budget','replay'])[1 + g % 4], :run, 'read#1',
        'bench ' || g, '{}'
    FROM generate_series(1, 12) AS g
    """,
]

# What EXTRA added (console_store's fill writes no letters, incidents or audit rows).
REMOVE = [
    "DELETE FROM fleet_dead_letters",
    "DELETE FROM fleet_incidents",
    "DELETE FROM fleet_audit WHERE run_id = :run",
    "DELETE FROM fleet_attempts WHERE run_id = :run",
    "DELETE FROM fleet_steps WHERE run_id = :run",
    "DELETE FROM fleet_runs WHERE id = :run",
]


def add_long_run(db: Database, letters: int) -> None:
    params = {"run": LONG, "last": STEPS - 1, "letters": letters, "tb": TRACEBACK}
    with db.begin() as conn:
        for statement in REMOVE + EXTRA:
            conn.execute(text(statement), params)
        conn.execute(text("ANALYZE fleet_steps, fleet_attempts, fleet_dead_letters"))


def remove_long_run(db: Database) -> None:
    with db.begin() as conn:
        for statement in REMOVE:
            conn.execute(text(statement), {"run": LONG})


def prepare(runs: int, keep: bool, letters: int) -> float | None:
    """The filled database (refilled unless ``keep`` finds ``runs``) with the long run
    added; seconds the fill took, None when reused."""
    db = Database(URL) if keep else None
    try:
        reusable = False
        if db is not None:
            try:
                remove_long_run(db)
                reusable = filled(db) == runs
            except StoreUnavailable:  # no such database yet
                reusable = False
        if not reusable:
            if db is not None:
                db.dispose()
            fresh_database()
            db = Database(URL)
            migrate.upgrade(db)
            print(f"filling {runs} runs...", flush=True)
            seconds: float | None = fill(db, runs, 2)
            print(f"filled in {seconds:.1f}s", flush=True)
        else:
            seconds = None
            print(f"reusing {NAME}: {runs} runs", flush=True)
        assert db is not None
        add_long_run(db, letters)
        return seconds
    finally:
        if db is not None:
            db.dispose()


class Statements:
    """Every statement the Fleet's engine sends, with when it was sent; ``sets`` the
    times of those that only set a transaction's options (``SET LOCAL``)."""

    def __init__(self, fleet: Fleet) -> None:
        self.at: list[float] = []
        self.sets: list[float] = []
        event.listen(fleet.runtime.db.engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.at.append(time.monotonic())
        if statement.lstrip().upper().startswith("SET "):
            self.sets.append(self.at[-1])

    def __len__(self) -> int:
        return len(self.at)


def figures(ms: list[float], queries: list[int]) -> dict[str, Any]:
    return {
        "median_ms": round(statistics.median(ms), 1),
        "p95_ms": round(percentile(ms, 95), 1),
        "max_ms": round(max(ms), 1),
        "min_ms": round(min(ms), 1),
        "statements": max(queries),
        "n": len(ms),
    }


async def time_pages(fleet: Fleet, count: Statements, reps: int) -> dict[str, Any]:
    db = fleet.runtime.db
    deep = deep_cursor(db, 0.9)
    web = console_app(fleet, no_auth=True)
    transport = httpx.ASGITransport(app=web)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as http:
        first = await http.get("/runs")
        second = first.text.split('id="next-page" href="', 1)[1].split('"', 1)[0]
        second = second.replace("&amp;", "&")
        letter = await first_letter(http)
        urls = {
            "/runs": "/runs",
            "/runs, next page (a#next-page)": second,
            "/runs, deep page (cursor at 90%)": "/runs?" + urlencode({"after": deep}),
            "/runs?status=succeeded": "/runs?status=succeeded",
            "/runs?status=waiting (rare)": "/runs?status=waiting",
            "/runs?workflow=flow_3": "/runs?workflow=flow_3",
            "/runs?tenant=tenant-42": "/runs?tenant=tenant-42",
            "/runs?tenant=tenant-42&status=failed": "/runs?tenant=tenant-42&status=failed",
            "/runs?since=2h": "/runs?since=2h",
            "/runs?since=11d&until=10d": "/runs?since=11d&until=10d",
            "/runs?q=run-0050 (prefix)": "/runs?q=run-0050",
            "/runs?q=<exact id> (303)": f"/runs?q=run-{1:08}",
            f"/runs/{LONG} (1,000 steps)": f"/runs/{LONG}",
            "/runs/<a 2-step run>": f"/runs/run-{1:08}",
            "/inbox": "/inbox",
            "/dead-letters": "/dead-letters",
            "/dead-letters?workflow=flow_long": "/dead-letters?workflow=flow_long",
            "/dead-letters/<id>": f"/dead-letters/{letter}",
            "/fleet": "/fleet",
            "/audit": "/audit",
        }
        found = {}
        for name, url in urls.items():
            ms, queries = [], []
            for rep in range(reps + 1):
                before = len(count)
                started = time.perf_counter()
                response = await http.get(url)
                elapsed = 1000 * (time.perf_counter() - started)
                if response.status_code not in (200, 303):
                    raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
                if rep:  # the first is a warm-up
                    ms.append(elapsed)
                    queries.append(len(count) - before)
            found[name] = {**figures(ms, queries), "bytes": len(response.content)}
            f = found[name]
            print(
                f"{name:<44} {f['median_ms']:7.1f} ms  p95 {f['p95_ms']:7.1f}  "
                f"max {f['max_ms']:7.1f}  {f['statements']:3} stmts",
                flush=True,
            )
    return found


async def first_letter(http: httpx.AsyncClient) -> str:
    page = (await http.get("/dead-letters?workflow=flow_long")).text
    return page.split('data-letter-id="', 1)[1].split('"', 1)[0]


@contextmanager
def moving(run_id: str, every: float) -> Iterator[list[int]]:
    """Bump the run's ``updated_at`` every ``every`` seconds from another connection
    (as a worker's commit would); yields the list the count of changes lands in."""
    done = threading.Event()
    changes = [0]

    def bump() -> None:
        with psycopg.connect(URL.replace("+psycopg", ""), autocommit=True) as conn:
            while not done.wait(every):
                conn.execute(
                    "UPDATE fleet_runs SET updated_at = updated_at + 1 WHERE id = %s", (run_id,)
                )
                changes[0] += 1

    thread = threading.Thread(target=bump, daemon=True)
    thread.start()
    try:
        yield changes
    finally:
        done.set()
        thread.join()


async def watch(fleet: Fleet, count: Statements, k: int, seconds: float) -> dict[str, Any]:
    """K streams on the long run for ``seconds``: statements per 1-second bucket."""
    web = console_app(fleet, no_auth=True, stream_seconds=seconds)
    transport = httpx.ASGITransport(app=web)
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://console", timeout=seconds + 60, limits=limits
    ) as http:
        before, sets_before = len(count), len(count.sets)
        start = time.monotonic()
        responses = await asyncio.gather(
            *(http.get("/events/run", params={"id": LONG}) for _ in range(k))
        )
        end = time.monotonic()
    stamps = [t - start for t in count.at[before:]]
    sets = [t - start for t in count.sets[sets_before:]]
    events = [r.text.count("event: update") for r in responses]
    if any(r.status_code != 200 for r in responses) or min(events) < 1:
        raise RuntimeError(f"a stream failed: {[r.status_code for r in responses][:5]}")
    buckets = [sum(1 for t in stamps if i <= t < i + 1) for i in range(int(seconds) + 1)]
    # Steady state: from 2 s on (every stream open, the first render done).
    steady = [t for t in stamps if STEADY <= t < seconds]
    steady_sets = [t for t in sets if STEADY <= t < seconds]
    return {
        "watchers": k,
        "seconds": round(end - start, 2),
        "statements": len(stamps),
        "per_second_buckets": buckets,
        "at_open": sum(1 for t in stamps if t < STEADY),
        "steady_per_second": round(len(steady) / (seconds - STEADY), 2),
        "steady_reads_per_second": round((len(steady) - len(steady_sets)) / (seconds - STEADY), 2),
        "updates_per_stream": [min(events), max(events)],
    }


async def watchers(fleet: Fleet, count: Statements, seconds: float) -> dict[str, Any]:
    found: dict[str, Any] = {"idle": [], "moving": []}
    for k in (1, 10, 100):
        found["idle"].append(await watch(fleet, count, k, seconds))
        with moving(LONG, 0.5) as changes:
            found["moving"].append(await watch(fleet, count, k, seconds))
        found["moving"][-1]["run_changes"] = changes[0]
        for kind in ("idle", "moving"):
            w = found[kind][-1]
            print(
                f"watchers={k:<3} {kind:<6} {w['statements']:4} statements in "
                f"{w['seconds']}s  per second {w['per_second_buckets']}  steady "
                f"{w['steady_per_second']}/s (reads {w['steady_reads_per_second']}/s)  "
                f"updates/stream {w['updates_per_stream']}",
                flush=True,
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="reuse a filled database")
    parser.add_argument("--letters", type=int, default=2000, help="dead letters to add")
    parser.add_argument("--watch", type=float, default=6.0, help="seconds per watch")
    parser.add_argument("--out", default="console", help="bench/out/<OUT>.json")
    args = parser.parse_args()
    fill_seconds = prepare(args.runs, args.keep, args.letters)
    fleet = Fleet("bench-console", database_url=URL, broker_url=BROKER)
    try:
        count = Statements(fleet)
        pages = asyncio.run(time_pages(fleet, count, args.reps))
        watched = asyncio.run(watchers(fleet, count, args.watch))
    finally:
        fleet.runtime.db.dispose()
        cleanup = Database(URL)
        remove_long_run(cleanup)
        cleanup.dispose()
    result = {
        "runs": args.runs,
        "long_run_steps": STEPS,
        "dead_letters": args.letters + 1,
        "fill_seconds": fill_seconds,
        "pages": pages,
        "watchers": watched,
    }
    print(f"written to {save(args.out, result)}")


if __name__ == "__main__":
    main()
