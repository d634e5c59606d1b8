"""Benchmark 2 of issue #7, many runs: 200 runs of 10 no-op steps each on 2 fleet worker
processes, in steps per second from the first enqueue until every run has finished
(the store's own clock: first run created to last run finished) — against 2,000
independent raw Celery no-op tasks (``acks_late``, no result backend, same Redis)
drained by 2 raw Celery worker processes with the same pool and concurrency, timed
from the first publish until the queue and the unacknowledged set are both empty — and
against the floor of a durable step on the same workers: 200 raw Celery tasks each
committing 10 rows to Postgres one at a time (``raw.checkpoints``: one message per run,
one single-statement transaction per step, nothing else), the least any engine that
checkpoints every step can do here.

    .venv/bin/python -m bench.many_runs [--reps 3] [--runs 200] [--live 0]

Beside the rates, the CPU the whole machine spent per step and per task, and by kind of
process (``bench/cpu.py``): both sides keep the 2 cores busy, so their ratio of CPU per
unit is the ratio of rates they allow.

A measurement, never a test: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench import raw_celery
from bench.common import save, services, spread, wait_until
from bench.cpu import CpuMeter
from bench.drivers import (
    POOLS,
    SUCCEEDED,
    RunClock,
    celery_app,
    celery_workers,
    fleet_client,
    fleet_workers,
)

STEPS_PER_RUN = 10  # the ``ten`` workflow
WORKERS = 2
TARGET = 0.8


def measure_fleet(
    runs: int, concurrency: int, pool: str, **env: str
) -> tuple[float, float, CpuMeter]:
    """``runs`` runs of ``ten()`` on 2 fleet workers: (steps/s, seconds spent enqueueing,
    the CPU the machine spent meanwhile)."""
    with services("many") as svc:
        client = fleet_client(svc)
        clock = RunClock(svc)
        with fleet_workers(svc, WORKERS, concurrency, pool, **env):
            cpu = CpuMeter().start()
            started = time.perf_counter()
            run_ids = [client.enqueue("ten").id for _ in range(runs)]
            enqueued = time.perf_counter() - started
            seconds = clock.wait(run_ids, timeout=240)
            cpu.stop()
        clock.close()
        client.runtime.db.dispose()
    return runs * STEPS_PER_RUN / seconds, enqueued, cpu


def _drained(redis: Any) -> bool:
    """Nothing queued and nothing delivered but unacknowledged (acks are late: a task is
    acknowledged once it has run)."""
    pipe = redis.pipeline(transaction=True)
    pipe.llen(raw_celery.QUEUE).hlen("unacked")
    queued, unacked = pipe.execute()
    return queued == 0 and unacked == 0


def _succeeded(procs: list[Any]) -> int:
    return sum(p.output().count(SUCCEEDED) for p in procs)


def measure_celery(tasks: int, concurrency: int, pool: str) -> tuple[float, float, CpuMeter]:
    """``tasks`` independent no-op tasks on 2 raw Celery workers: (steps/s, seconds spent
    publishing, the CPU the machine spent meanwhile). Checks afterwards, from the
    workers' logs, that every task ran."""
    with services("manyraw") as svc:
        noop = celery_app(svc).tasks["raw.noop"]
        redis = svc.redis()
        with celery_workers(svc, WORKERS, concurrency, pool) as procs:
            cpu = CpuMeter().start()
            started = time.perf_counter()
            for i in range(tasks):
                noop.delay(i)
            published = time.perf_counter() - started
            wait_until(lambda: _drained(redis), 240, "the raw Celery queue", interval=0.01)
            seconds = time.perf_counter() - started
            cpu.stop()
            wait_until(lambda: _succeeded(procs) >= tasks, 30, f"{tasks} tasks in the logs")
    return tasks / seconds, published, cpu


def measure_floor(runs: int, concurrency: int, pool: str) -> tuple[float, CpuMeter]:
    """``runs`` raw Celery tasks on 2 raw Celery workers, each committing
    ``STEPS_PER_RUN`` rows one at a time: (steps/s, the CPU the machine spent meanwhile).
    Checks afterwards that every row is there."""
    import psycopg

    with services("manyfloor") as svc:
        with psycopg.connect(svc.libpq_url, autocommit=True) as conn:
            conn.execute(raw_celery.CHECKPOINTS_TABLE)
            task = celery_app(svc).tasks["raw.checkpoints"]
            redis = svc.redis()
            with celery_workers(svc, WORKERS, concurrency, pool):
                cpu = CpuMeter().start()
                started = time.perf_counter()
                for run in range(runs):
                    task.delay(run, STEPS_PER_RUN)
                wait_until(lambda: _drained(redis), 240, "the floor's queue", interval=0.01)
                seconds = time.perf_counter() - started
                cpu.stop()
            row = conn.execute("SELECT count(*) FROM raw_checkpoints").fetchone()
        rows = row[0] if row else 0
        if rows != runs * STEPS_PER_RUN:
            raise RuntimeError(f"the floor committed {rows} rows, not {runs * STEPS_PER_RUN}")
    return rows / seconds, cpu


def one_rep(runs: int, concurrency: int, pool: str, **env: str) -> dict[str, Any]:
    steps = runs * STEPS_PER_RUN
    fleet, fleet_enqueue, fleet_cpu = measure_fleet(runs, concurrency, pool, **env)
    celery, celery_publish, celery_cpu = measure_celery(steps, concurrency, pool)
    floor, floor_cpu = measure_floor(runs, concurrency, pool)
    out = {
        "fleet_steps_per_s": fleet,
        "fleet_enqueue_s": fleet_enqueue,
        "celery_steps_per_s": celery,
        "celery_publish_s": celery_publish,
        "fleet/celery": fleet / celery,
        "floor_steps_per_s": floor,
        "floor/celery": floor / celery,
        "fleet/floor": fleet / floor,
    }
    # Each side keeps the cores busy, so its rate is bounded by what one unit of its
    # work costs the whole machine.
    for side, cpu in (("fleet", fleet_cpu), ("celery", celery_cpu), ("floor", floor_cpu)):
        for kind, ms in cpu.per_unit_ms(steps).items():
            out[f"{side}_cpu_ms_{kind}"] = ms
    out["cpu_ratio"] = out["celery_cpu_ms_machine"] / out["fleet_cpu_ms_machine"]
    return out


def report(reps: list[dict[str, Any]]) -> dict[str, str]:
    """Print the table (the target judged on the median); return the medians and ranges
    that are saved."""
    col = {k: [r[k] for r in reps] for k in reps[0]}
    ok = statistics.median(col["fleet/celery"]) >= TARGET
    rows = [
        ("fleet steps/s", spread(col["fleet_steps_per_s"]), ""),
        ("  time to enqueue the runs, s", spread(col["fleet_enqueue_s"], "{:.2f}"), ""),
        ("raw Celery tasks/s", spread(col["celery_steps_per_s"]), ""),
        ("  time to publish the tasks, s", spread(col["celery_publish_s"], "{:.2f}"), ""),
        (
            "fleet/celery",
            spread(col["fleet/celery"], "{:.2f}"),
            f"target >= {TARGET}: {'met' if ok else 'MISSED'}",
        ),
        ("durable floor steps/s (raw.checkpoints)", spread(col["floor_steps_per_s"]), ""),
        (
            "  floor/celery",
            spread(col["floor/celery"], "{:.2f}"),
            "the most a durable step can reach here",
        ),
        ("  fleet/floor", spread(col["fleet/floor"], "{:.2f}"), ""),
        *(
            (f"  CPU per unit, ms: {name}", spread(col[name], "{:.2f}"), "")
            for name in col
            if "_cpu_ms_" in name
        ),
        (
            "celery CPU / fleet CPU per unit",
            spread(col["cpu_ratio"], "{:.2f}"),
            "the ratio both CPU-bound sides allow",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:<34} {note}")
    return {k: spread(v, "{:.3f}") for k, v in col.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool", choices=POOLS, default="threads")
    parser.add_argument("--live", type=int, help="the workers' FLEET_LIVE_RUNS (0: replay)")
    args = parser.parse_args()
    env = {} if args.live is None else {"FLEET_LIVE_RUNS": str(args.live)}
    print(
        f"many runs: {args.runs} runs x {STEPS_PER_RUN} no-op steps vs "
        f"{args.runs * STEPS_PER_RUN} raw Celery tasks, {WORKERS} workers each "
        f"(--pool {args.pool} --concurrency {args.concurrency}), {args.reps} rep(s)"
    )
    reps = []
    for i in range(args.reps):
        reps.append(one_rep(args.runs, args.concurrency, args.pool, **env))
        r = reps[-1]
        print(
            f"  rep {i + 1}: fleet {r['fleet_steps_per_s']:.0f} steps/s, "
            f"celery {r['celery_steps_per_s']:.0f} tasks/s, "
            f"floor {r['floor_steps_per_s']:.0f} steps/s",
            flush=True,
        )
    summary = report(reps)
    path = save(
        "many_runs", {"params": vars(args), "target": TARGET, "summary": summary, "reps": reps}
    )
    print(f"  saved {path}")


if __name__ == "__main__":
    main()
