"""Benchmark 3 of issue #7: I/O-bound agents on one host.

Measures how close a worker comes to the throughput its pool allows when every step is
a 1 s blocking wait (``time.sleep``, a stand-in for a model call): 2,000 steps spread over
concurrent sequential runs (100 runs x 20 steps on a thread pool of 100; 200 x 10 on a
gevent pool of 200). The limit is ``min(slots, runs in flight) / step latency`` steps/s;
the figure is achieved steps/s over that limit (target >= 0.8), with the wall time read
from the store (first run created to last run finished). Diagnostics, per step: the gap
from one step's commit to the next step's lease in the same run (replay, dispatch,
broker, lease), the workers' CPU time, the store's committed transactions, and the
Postgres connections the workers opened.

Configurations (each on a fresh database, one probe batch of one-step runs as warm-up):

* ``gevent``: ``python -m fleet worker --pool gevent --concurrency 200``. Before 258bac1
  nothing monkey-patched the worker (Celery does it in its own ``celery`` entry point
  only): it ran Celery's blocking event loop and the pool's greenlets never started. If
  the probe does not finish in 15 s, the full size is skipped and the hang reported.
* ``threads``: ``--pool threads --concurrency 100``.
* ``gevent x2``, ``threads x2``: the same slots in two worker processes, one per core
  (one interpreter's GIL caps a process near one core's worth of steps).

    .venv/bin/python -m bench.io_bound [--reps 3] [--only gevent,threads,"gevent x2","threads x2"]
        [--enqueue sync|async]
    .venv/bin/python -m bench.io_bound --reps 1 --runs 20 --steps 3   # smoke test

No sweeper runs (nothing is lost here). Redis DB 13 only. Figures are printed and
written to ``bench/out/io_bound.json``; nothing asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench import agent_flows
from bench.common import percentile, processes, save, services, spread, wait_until
from fleet import Fleet
from fleet.testing import WORKER_READY, worker_argv

APP = "bench.agent_flows"
REDIS_DB = 13
TARGET = 0.8
PROBE_RUNS = 20
PROBE_TIMEOUT = 15.0


@dataclass(frozen=True)
class Config:
    """Worker processes on this host: pool, concurrency each, and the runs x steps given."""

    label: str
    pool: str
    concurrency: int
    runs: int
    steps: int
    processes: int = 1

    def limit(self, seconds: float) -> float:
        """Steps/s the pools allow: every slot busy, capped by the runs in flight."""
        return min(self.concurrency * self.processes, self.runs) / seconds


CONFIGS = (
    Config("gevent", "gevent", 200, 200, 10),
    Config("threads", "threads", 100, 100, 20),
    # The same slots in two processes (one per core), past one interpreter's GIL.
    Config("gevent x2", "gevent", 100, 200, 10, processes=2),
    Config("threads x2", "threads", 50, 100, 20, processes=2),
    # Issue 19's second gevent figure: 400 greenlets over two processes.
    Config("gevent 2x200", "gevent", 200, 400, 10, processes=2),
)
DEFAULT = ("gevent", "threads", "gevent x2", "threads x2")


@dataclass
class Batch:
    """The figures of one batch of runs enqueued together."""

    runs: int
    steps: int
    enqueue_s: float
    wall_s: float
    steps_per_s: float
    ratio: float
    gap_p50_ms: float
    gap_p99_ms: float
    first_step_p50_ms: float
    extra_attempts: int
    failed_runs: int
    worker_cpu_ms_per_step: float
    commits_per_step: float
    sessions_opened: int


@dataclass(frozen=True)
class Counters:
    """Cumulative counters read before and after a batch."""

    cpu_s: float
    commits: int
    sessions: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.cpu_s - other.cpu_s, self.commits - other.commits, self.sessions - other.sessions
        )


def query(client: Fleet, sql: str, **params: Any) -> list[Any]:
    """Rows of a read-only query on the benchmark's store."""
    with client.runtime.db.engine.connect() as conn:
        return list(conn.execute(text(sql), params))


def finished(client: Fleet, ids: list[str]) -> int:
    """How many of ``ids`` have ended."""
    rows = query(
        client,
        "SELECT count(*) FROM fleet_runs WHERE id = ANY(:ids) AND finished_at IS NOT NULL",
        ids=ids,
    )
    return int(rows[0][0])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counters(client: Fleet, pids: list[int]) -> Counters:
    """The workers' CPU time, and the store's committed transactions and sessions opened
    (``pg_stat_database``: flushed by Postgres about once a second, so approximate)."""
    (row,) = query(
        client,
        "SELECT xact_commit, sessions FROM pg_stat_database WHERE datname = current_database()",
    )
    cpu = sum(cpu_seconds(pid) for pid in pids)
    return Counters(cpu, int(row.xact_commit), int(row.sessions))


def gaps_ms(attempts: list[Any]) -> tuple[list[float], int]:
    """Per run, the time from one attempt's end to the next one's start; and how many
    attempts beyond the first of a step there were (retries, duplicates)."""
    gaps: list[float] = []
    seen: set[tuple[str, str]] = set()
    extra = 0
    prev: Any = None
    for row in attempts:  # ordered by run, then start
        if (row.run_id, row.step_id) in seen:
            extra += 1
        seen.add((row.run_id, row.step_id))
        if prev is not None and prev.run_id == row.run_id and prev.finished_at is not None:
            gaps.append((row.started_at - prev.finished_at) * 1000)
        prev = row
    return gaps, extra


def first_steps_ms(attempts: list[Any]) -> list[float]:
    """Per run, from its creation to its first step's start (the first advance)."""
    first: dict[str, float] = {}
    for a in attempts:  # ordered by run, then start
        first.setdefault(a.run_id, (a.started_at - a.created_at) * 1000)
    return list(first.values())


def run_batch(
    client: Fleet,
    cfg: Config,
    seconds: float,
    timeout: float,
    pids: list[int],
    workflow: Any = agent_flows.agent,
    enqueue: Callable[[Fleet, Any, int, list[Any]], list[str]] | None = None,
) -> tuple[list[str], float, Counters]:
    """Enqueue ``cfg.runs`` runs of ``workflow`` (the agent unless given) at once, one
    after another (or by ``enqueue(client, workflow, runs, args)``), and wait for all of
    them to end: their ids, the enqueue time and what the batch used."""
    before = counters(client, pids)
    t0 = time.perf_counter()
    if enqueue is not None:
        ids = enqueue(client, workflow, cfg.runs, [cfg.steps, seconds])
    else:
        ids = [client.enqueue(workflow, cfg.steps, seconds).id for _ in range(cfg.runs)]
    enqueue_s = time.perf_counter() - t0
    wait_until(lambda: finished(client, ids) == len(ids), timeout, "the runs to end", 0.25)
    time.sleep(1.0)  # let Postgres flush its statistics
    return ids, enqueue_s, counters(client, pids) - before


def measure(
    client: Fleet,
    cfg: Config,
    seconds: float,
    timeout: float,
    pids: list[int],
    enqueue: Callable[[Fleet, Any, int, list[Any]], list[str]] | None = None,
) -> Batch:
    """One batch, its figures read from the store's clock."""
    ids, enqueue_s, used = run_batch(client, cfg, seconds, timeout, pids, enqueue=enqueue)
    return batch_figures(client, cfg, seconds, ids, enqueue_s, used)[0]


def batch_figures(
    client: Fleet, cfg: Config, seconds: float, ids: list[str], enqueue_s: float, used: Counters
) -> tuple[Batch, list[Any]]:
    """A finished batch's figures, read from the store's clock, and its attempts."""
    (span,) = query(
        client,
        "SELECT max(finished_at) - min(created_at) AS wall, "
        "count(*) FILTER (WHERE status <> 'succeeded') AS failed "
        "FROM fleet_runs WHERE id = ANY(:ids)",
        ids=ids,
    )
    attempts = query(
        client,
        "SELECT a.run_id, a.step_id, a.started_at, a.finished_at, r.created_at "
        "FROM fleet_attempts a JOIN fleet_runs r ON r.id = a.run_id "
        "WHERE a.run_id = ANY(:ids) ORDER BY a.run_id, a.started_at",
        ids=ids,
    )
    gaps, extra = gaps_ms(attempts)
    total = cfg.runs * cfg.steps
    rate = total / span.wall
    batch = Batch(
        cfg.runs,
        cfg.steps,
        enqueue_s,
        span.wall,
        rate,
        rate / cfg.limit(seconds),
        percentile(gaps, 50),
        percentile(gaps, 99),
        percentile(first_steps_ms(attempts), 50),
        extra,
        int(span.failed),
        used.cpu_s * 1000 / total,
        used.commits / total,
        used.sessions,
    )
    return batch, attempts


def probe(client: Fleet, cfg: Config, seconds: float, pids: list[int]) -> tuple[Batch | None, str]:
    """A few one-step runs, as a warm-up; None (and why) if they do not finish."""
    small = replace(cfg, runs=min(PROBE_RUNS, cfg.runs), steps=1)
    try:
        return measure(client, small, seconds, PROBE_TIMEOUT + seconds, pids), ""
    except TimeoutError as exc:
        (row,) = query(client, "SELECT count(*) FROM fleet_attempts")
        return None, f"{exc}; attempts started: {row[0]}"


def enqueue_async(client: Fleet, workflow: Any, runs: int, args: list[Any]) -> list[str]:
    """Every run enqueued at once with ``aenqueue``, as an async app would start them (one
    insert and one broker round per batch of calls that arrive together)."""

    async def start() -> list[str]:
        handles = await asyncio.gather(*(client.aenqueue(workflow, *args) for _ in range(runs)))
        return [h.id for h in handles]

    return asyncio.run(start())


# How a batch's runs are enqueued: one ``enqueue`` after another, or all at once.
ENQUEUE: dict[str, Any] = {"sync": None, "async": enqueue_async}


def run_config(cfg: Config, reps: int, seconds: float, how: str = "sync") -> dict[str, Any]:
    """One fresh store and worker for ``cfg``: a probe, then ``reps`` measured batches,
    their runs enqueued ``how`` (``ENQUEUE``)."""
    with services(f"io_{cfg.pool}", redis_db=REDIS_DB) as svc:
        client = agent_flows.bind(svc.env())
        client.upgrade_schema()
        argv = worker_argv(APP, cfg.concurrency, cfg.pool)
        workers = [(f"worker{i}", argv) for i in range(1, cfg.processes + 1)]
        with processes(svc, workers, WORKER_READY) as procs:
            pids = [p.pid for p in procs]
            warm, why = probe(client, cfg, seconds, pids)
            if warm is None:
                return {"config": asdict(cfg), "hung": why, "log_tail": tail(procs[0])}
            timeout = cfg.steps * seconds * 20 + 60
            batches = [
                measure(client, cfg, seconds, timeout, pids, ENQUEUE[how]) for _ in range(reps)
            ]
    return {"config": asdict(cfg), "probe": asdict(warm), "batches": [asdict(b) for b in batches]}


def tail(proc: Any, lines: int = 5) -> list[str]:
    """The last lines of a worker's log (for a configuration that hung)."""
    return [f"log: {proc.log}", *proc.output().splitlines()[-lines:]]


def median_of(batches: list[dict[str, Any]], key: str) -> float:
    """The median of one figure over the batches (NaN if there are none)."""
    values = [b[key] for b in batches]
    return statistics.median(values) if values else float("nan")


def summarise(
    result: dict[str, Any], seconds: float, kind: type[Config] = Config, target: float = TARGET
) -> dict[str, Any]:
    """Median and spread of the batches of one configuration (a ``kind``), and the
    verdict against ``target``."""
    cfg = kind(**result["config"])
    batches = result.get("batches", [])
    ratios = [b["ratio"] for b in batches]
    med = statistics.median(ratios) if ratios else 0.0
    return {
        "label": cfg.label,
        "shape": f"{cfg.processes}x {cfg.pool} c={cfg.concurrency}, {cfg.runs}x{cfg.steps}",
        "limit": cfg.limit(seconds),
        "steps_per_s": spread([b["steps_per_s"] for b in batches]),
        "ratio": spread(ratios, "{:.2f}"),
        "verdict": "HUNG" if result.get("hung") else "met" if med >= target else "MISSED",
        "ratio_median": med,
        "diagnostics": {
            key: median_of(batches, key)
            for key in (
                "gap_p50_ms",
                "gap_p99_ms",
                "first_step_p50_ms",
                "worker_cpu_ms_per_step",
                "commits_per_step",
                "sessions_opened",
                "enqueue_s",
            )
        },
        "hung": result.get("hung", ""),
    }


def report(
    results: list[dict[str, Any]],
    seconds: float,
    kind: type[Config] = Config,
    target: float = TARGET,
) -> list[dict[str, Any]]:
    """Print the tables; return the summaries for the JSON."""
    rows = [summarise(r, seconds, kind, target) for r in results]
    print(f"\nI/O-bound agents: {seconds:g} s steps on one host; target ratio >= {target}")
    print(f"{'config':<13} {'pool, runs x steps':<28} {'limit/s':>7}  {'steps/s':<24} ratio")
    for s in rows:
        print(
            f"{s['label']:<13} {s['shape']:<28} {s['limit']:>7.0f}  "
            f"{s['steps_per_s']:<24} {s['ratio']}  {s['verdict']}"
        )
    print(
        "medians: step-to-step gap p50/p99 ms | worker CPU ms/step | "
        "store commits/step | connections opened"
    )
    for s in rows:
        d = s["diagnostics"]
        if s["hung"]:
            print(f"  {s['label']:<13} HUNG ({s['shape']}): {s['hung']}")
            continue
        print(
            f"  {s['label']:<13} {d['gap_p50_ms']:.0f}/{d['gap_p99_ms']:.0f} | "
            f"{d['worker_cpu_ms_per_step']:.1f} | {d['commits_per_step']:.1f} | "
            f"{d['sessions_opened']:.0f}"
        )
    return rows


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--runs", type=int, help="runs per batch, every configuration")
    p.add_argument("--steps", type=int, help="steps per run, every configuration")
    p.add_argument("--seconds", type=float, default=1.0, help="latency of one step")
    p.add_argument(
        "--only",
        default=",".join(DEFAULT),
        help="comma-separated labels of: " + ", ".join(c.label for c in CONFIGS),
    )
    p.add_argument(
        "--enqueue",
        choices=sorted(ENQUEUE),
        default="sync",
        help="a batch's runs enqueued one after another (sync) or at once (aenqueue)",
    )
    return p.parse_args()


def main() -> None:
    args = parse()
    configs = [
        replace(c, runs=args.runs or c.runs, steps=args.steps or c.steps)
        for c in CONFIGS
        if c.label in args.only.split(",")
    ]
    results: list[dict[str, Any]] = []
    load = os.getloadavg()
    for cfg in configs:
        print(f"{cfg.label}: {cfg.runs} runs x {cfg.steps} steps, {args.reps} rep(s)...")
        results.append(run_config(cfg, args.reps, args.seconds, args.enqueue))
    summary = report(results, args.seconds)
    path = save(
        "io_bound",
        {
            "seconds": args.seconds,
            "enqueue": args.enqueue,
            "loadavg_before": load,
            "loadavg_after": os.getloadavg(),
            "summary": summary,
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
