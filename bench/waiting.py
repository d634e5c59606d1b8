"""Benchmark 5 of issue #7: the cost of waiting.

Parks many runs (10,000 by default) of ``bench.agent_flows.approval`` (one no-op step,
``wf.wait_for("go")``, one no-op step) and measures what they cost while they wait:

* enqueue rate: ``Fleet.enqueue`` called in a loop from one client thread, no worker
  running (the public API has no bulk path); then park rate: workers started on the
  backlog, until every run is ``waiting``;
* worker slots held while they wait (target 0): active tasks by ``celery inspect active``
  and running leases in the store, with the parking workers still up; then a fresh run
  of the same workflow (its signal sent at enqueue) on a concurrency-1 worker: if waiting
  held a slot, it could not finish;
* store rows and bytes per waiting run, per table: live row bytes (``pg_column_size``)
  and on-disk size (``pg_total_relation_size``: heap, TOAST and indexes, dead row
  versions included), divided by the runs; keys in the broker's Redis DB; the time of
  one sweeper tick (``sweep_once``) over that many waiting runs;
* signal-to-resumed latency: ``--sample`` parked runs signalled at ``--rate`` per second
  by ``Fleet.signal``; from just before each call to the resumed run's next step
  starting (its attempt's ``started_at``) and to the run finishing (``finished_at``),
  both on the store's clock (same host as this client); and from just after the call
  returned to the step starting (the workers' part, without the call's own time).

Parking is slow (two runs' worth of replays and leases per run), so it is done once and
the latency sample is repeated ``--reps`` times, each on runs not signalled before.

    .venv/bin/python -m bench.waiting [--runs 10000] [--reps 3]
    .venv/bin/python -m bench.waiting --runs 300 --sample 50 --reps 1   # smoke test

Redis DB 13 only. Figures are printed and written to ``bench/out/waiting.json``;
nothing asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from bench import agent_flows
from bench.common import Services, percentile, processes, save, services, spread, wait_until
from fleet import Fleet
from fleet.testing import SWEEPER_READY, WORKER_READY, sweeper_argv, worker_argv
from fleet.worker.sweeper import sweep_once

APP = "bench.agent_flows"
REDIS_DB = 13
STALL = 60.0  # give up parking after this long without progress


def query(client: Fleet, sql: str, **params: Any) -> list[Any]:
    """Rows of a read-only query on the benchmark's store."""
    with client.runtime.db.engine.connect() as conn:
        return list(conn.execute(text(sql), params))


def count(client: Fleet, status: str) -> int:
    """Runs in ``status``."""
    return int(query(client, "SELECT count(*) FROM fleet_runs WHERE status = :s", s=status)[0][0])


def wait_progress(current: Callable[[], int], target: int, what: str) -> None:
    """Poll until ``current() >= target``; raise if it stops moving for ``STALL`` s."""
    last, moved = -1, time.monotonic()
    while (now := current()) < target:
        if now != last:
            last, moved = now, time.monotonic()
        elif time.monotonic() - moved > STALL:
            raise TimeoutError(f"{what}: stuck at {now}/{target} for {STALL:.0f}s")
        time.sleep(0.5)


# --- phase 1: enqueue and park ---------------------------------------------------------


def enqueue(client: Fleet, runs: int) -> tuple[list[str], float]:
    """Enqueue ``runs`` approval runs one by one; their ids and the seconds it took."""
    t0 = time.perf_counter()
    ids = [client.enqueue(agent_flows.approval).id for _ in range(runs)]
    return ids, time.perf_counter() - t0


def slots_held(client: Fleet) -> dict[str, Any]:
    """Tasks the workers are executing (celery inspect) and leases held in the store."""
    active = client.celery.control.inspect(timeout=2.0).active() or {}
    (leases,) = query(client, "SELECT count(*) FROM fleet_steps WHERE status = 'running'")
    return {
        "workers_answering": len(active),
        "active_tasks": sum(len(tasks) for tasks in active.values()),
        "leases_held": int(leases[0]),
    }


def park(client: Fleet, svc: Services, args: argparse.Namespace) -> dict[str, Any]:
    """Enqueue with no worker, then start the workers and wait until every run waits."""
    ids, enqueue_s = enqueue(client, args.runs)
    names = [f"park{i}" for i in range(1, args.workers + 1)]
    argv = worker_argv(APP, args.concurrency, "threads")
    with processes(svc, [(n, argv) for n in names], WORKER_READY):
        t0 = time.perf_counter()
        wait_progress(lambda: count(client, "waiting"), args.runs, "parking")
        park_s = time.perf_counter() - t0
        time.sleep(1.0)  # let the last replies settle before asking the workers
        held = slots_held(client)
    return {
        "ids": ids,
        "enqueue_s": enqueue_s,
        "enqueue_per_s": args.runs / enqueue_s,
        "park_s": park_s,
        "park_per_s": args.runs / park_s,
        "workers": f"{args.workers} x threads c={args.concurrency}",
        "held_while_parked": held,
    }


# --- phase 2: what waiting costs -------------------------------------------------------


def tables(client: Fleet) -> list[str]:
    """The store's tables (the benchmark database holds nothing else)."""
    rows = query(client, "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
    return [r[0] for r in rows]


def footprint(client: Fleet, runs: int) -> dict[str, dict[str, float]]:
    """Per table: rows, live row bytes and on-disk bytes (heap+TOAST, indexes) per run."""
    out: dict[str, dict[str, float]] = {}
    for table in tables(client):
        (row,) = query(
            client,
            f"SELECT count(*) AS n, coalesce(sum(pg_column_size(t.*)), 0) AS live, "
            f"pg_total_relation_size('{table}') AS total, pg_indexes_size('{table}') AS idx "
            f'FROM "{table}" t',
        )
        out[table] = {
            "rows": row.n / runs,
            "live_bytes": row.live / runs,
            "disk_bytes": row.total / runs,
            "index_bytes": row.idx / runs,
        }
    return out


def broker_keys(svc: Services) -> dict[str, int]:
    """Keys in the broker's Redis DB and their memory (``MEMORY USAGE``), in bytes."""
    r = svc.redis()
    keys = list(r.scan_iter(count=1000))
    return {"keys": len(keys), "bytes": sum(int(r.memory_usage(k) or 0) for k in keys)}


def sweep_ms(client: Fleet, times: int = 5) -> float:
    """Median duration of one sweeper tick over the store as it stands."""
    samples = []
    for _ in range(times):
        t0 = time.perf_counter()
        sweep_once(client.runtime)
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def fresh_runs(client: Fleet, svc: Services, reps: int) -> dict[str, Any]:
    """On a single concurrency-1 worker: fresh approval runs, each signalled at enqueue,
    enqueue to finish (store clock). A wait that held the slot would block them."""
    times = []
    with processes(svc, [("solo", worker_argv(APP, 1, "threads"))], WORKER_READY):
        held = slots_held(client)
        for _ in range(reps):
            run = client.enqueue(agent_flows.approval)
            client.signal(run.id, "go", {"fresh": True})
            run.wait(timeout=60, poll=0.02)
            (row,) = query(
                client,
                "SELECT finished_at - created_at AS s FROM fleet_runs WHERE id = :id",
                id=run.id,
            )
            times.append(float(row.s))
    return {"held_on_solo_worker": held, "fresh_run_s": times}


# --- phase 3: signal to resumed ---------------------------------------------------------


def send_signals(
    client: Fleet, ids: list[str], rate: float, returned: dict[str, float] | None = None
) -> tuple[dict[str, float], float]:
    """Signal each run at a steady ``rate``; the wall-clock time just before each call
    (and in ``returned``, just after it), and the median call duration (ms)."""
    sent: dict[str, float] = {}
    returned = {} if returned is None else returned
    calls = []
    start = time.perf_counter()
    for i, run_id in enumerate(ids):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent[run_id] = time.time()
        t0 = time.perf_counter()
        client.signal(run_id, "go", {"i": i})
        calls.append((time.perf_counter() - t0) * 1000)
        returned[run_id] = time.time()
    return sent, statistics.median(calls)


def succeeded(client: Fleet, ids: list[str]) -> int:
    """How many of ``ids`` have succeeded."""
    rows = query(
        client,
        "SELECT count(*) FROM fleet_runs WHERE id = ANY(:ids) AND status = 'succeeded'",
        ids=ids,
    )
    return int(rows[0][0])


def latency(client: Fleet, ids: list[str], rate: float) -> dict[str, float]:
    """One sample: signal ``ids``, wait for them to finish, read the store's timestamps."""
    t0 = time.perf_counter()
    returned: dict[str, float] = {}
    sent, call_ms = send_signals(client, ids, rate, returned)
    send_s = time.perf_counter() - t0
    wait_until(lambda: succeeded(client, ids) == len(ids), 120, "the signalled runs", 0.25)
    rows = query(
        client,
        "SELECT r.id, a.started_at, r.finished_at FROM fleet_runs r "
        "JOIN fleet_attempts a ON a.run_id = r.id AND a.step_id = 'noop#2' "
        "WHERE r.id = ANY(:ids)",
        ids=ids,
    )
    to_step = [(r.started_at - sent[r.id]) * 1000 for r in rows]
    to_end = [(r.finished_at - sent[r.id]) * 1000 for r in rows]
    # From the signal's return (committed, its advance sent): the workers' part alone.
    after_call = [(r.started_at - returned[r.id]) * 1000 for r in rows]
    return {
        "signals": len(ids),
        "achieved_rate": len(ids) / send_s,
        "signal_call_ms": call_ms,
        "to_step_p50_ms": percentile(to_step, 50),
        "to_step_p99_ms": percentile(to_step, 99),
        "to_end_p50_ms": percentile(to_end, 50),
        "to_end_p99_ms": percentile(to_end, 99),
        "after_call_p50_ms": percentile(after_call, 50),
        "after_call_p99_ms": percentile(after_call, 99),
    }


def latencies(
    client: Fleet, svc: Services, ids: list[str], args: argparse.Namespace
) -> list[dict[str, float]]:
    """``--reps`` samples of ``--sample`` runs each, with the parking workers' shape and
    a sweeper running (as in production)."""
    names = [f"resume{i}" for i in range(1, args.workers + 1)]
    argv = worker_argv(APP, args.concurrency, "threads")
    samples = []
    with (
        processes(svc, [(n, argv) for n in names], WORKER_READY),
        processes(svc, [("sweeper", sweeper_argv(APP))], SWEEPER_READY),
    ):
        for rep in range(args.reps):
            chunk = ids[rep * args.sample : (rep + 1) * args.sample]
            samples.append(latency(client, chunk, args.rate))
    return samples


# --- report ---------------------------------------------------------------------------


def print_footprint(fp: dict[str, dict[str, float]]) -> None:
    print(f"  {'table':<20} {'rows':>6} {'live B':>8} {'disk B':>8} {'of it index B':>14}")
    for table, f in fp.items():
        if f["rows"] >= 0.01:  # the other tables' fixed pages are in the total only
            print(
                f"  {table:<20} {f['rows']:>6.2f} {f['live_bytes']:>8.0f} "
                f"{f['disk_bytes']:>8.0f} {f['index_bytes']:>14.0f}"
            )
    total = {k: sum(f[k] for f in fp.values()) for k in ("rows", "live_bytes", "disk_bytes")}
    print(
        f"  {'total':<20} {total['rows']:>6.2f} {total['live_bytes']:>8.0f} "
        f"{total['disk_bytes']:>8.0f}"
    )


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    p, held, solo = result["park"], result["park"]["held_while_parked"], result["fresh"]
    slots = held["active_tasks"] + held["leases_held"] + solo["held_on_solo_worker"]["active_tasks"]
    print(f"\nCost of waiting: {args.runs} runs parked in wf.wait_for('go')")
    print(f"enqueue   {p['enqueue_per_s']:.0f} runs/s ({p['enqueue_s']:.1f} s, one client thread)")
    print(f"park      {p['park_per_s']:.0f} runs/s ({p['park_s']:.1f} s, {p['workers']})")
    print(
        f"slots held while waiting: {held['active_tasks']} active tasks on "
        f"{held['workers_answering']} worker(s), {held['leases_held']} leases; "
        f"target 0: {'met' if slots == 0 else 'MISSED'}"
    )
    print(
        "  fresh run (signalled at enqueue) on a concurrency-1 worker, enqueue to finish: "
        f"{spread(solo['fresh_run_s'], '{:.2f}')} s"
    )
    print("store per waiting run (bytes; disk includes dead row versions and indexes):")
    print_footprint(result["footprint"])
    b = result["broker"]
    print(f"broker: {b['keys']} keys, {b['bytes']} bytes in Redis DB {REDIS_DB} in all")
    print(f"sweeper tick over {args.runs} waiting runs: {result['sweep_ms']:.1f} ms")
    s = result["latency"]
    print(f"signal to resumed, {args.sample} signals at {args.rate:g}/s, ms (over reps):")
    for label, key in (
        ("next step started", "to_step"),
        ("run finished", "to_end"),
        ("step, from return", "after_call"),
    ):
        p50 = spread([x[f"{key}_p50_ms"] for x in s], "{:.0f}")
        p99 = spread([x[f"{key}_p99_ms"] for x in s], "{:.0f}")
        print(f"  {label:<18} p50 {p50}  p99 {p99}")
    print(
        f"  Fleet.signal() call p50 {spread([x['signal_call_ms'] for x in s], '{:.1f}')} ms; "
        f"achieved rate {spread([x['achieved_rate'] for x in s])}/s"
    )


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10_000, help="runs to park")
    p.add_argument("--reps", type=int, default=3, help="latency samples")
    p.add_argument("--sample", type=int, default=500, help="runs signalled per sample")
    p.add_argument("--rate", type=float, default=50.0, help="signals per second")
    p.add_argument("--workers", type=int, default=2, help="worker processes (threads pool)")
    p.add_argument("--concurrency", type=int, default=4, help="threads per worker")
    args = p.parse_args()
    if args.sample * args.reps > args.runs:
        p.error("--sample x --reps must not exceed --runs")
    return args


def main() -> None:
    args = parse()
    with services("waiting", redis_db=REDIS_DB) as svc:
        client = agent_flows.bind(svc.env())
        client.upgrade_schema()
        parked = park(client, svc, args)
        ids = parked.pop("ids")
        result = {
            "loadavg_before": os.getloadavg(),
            "runs": args.runs,
            "park": parked,
            "footprint": footprint(client, args.runs),
            "broker": broker_keys(svc),
            "sweep_ms": sweep_ms(client),
        }
        result["fresh"] = fresh_runs(client, svc, 3)
        result["latency"] = latencies(client, svc, ids, args)
        result["loadavg_after"] = os.getloadavg()
    report(result, args)
    print(f"wrote {save('waiting', {'args': vars(args), **result})}")


if __name__ == "__main__":
    main()
