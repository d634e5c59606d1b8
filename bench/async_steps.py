"""``bench.io_bound`` with ``async def`` steps (issue #20): how many concurrent awaiting
steps one threads-pool worker process sustains.

Every step awaits ``asyncio.sleep(seconds)`` (a stand-in for an async model call) on the
worker process's one event loop, its attempt off its slot as a greenlet on a strand
(``fleet/worker/strands.py``; the ``on slots`` configuration sets
``FLEET_ASYNC_AWAITING=0``, where each slot's thread waits for its coroutine, as before
strands). The limit is ``min(slots + room off them, runs in flight) / step latency``
steps/s; the figure is achieved steps/s over it (the issue's target: >= 0.9 at 500),
with the wall time read from the store (first run created to last run finished), and
the worker's CPU per step beside the sync figure of ``bench.io_bound``. Each measured
batch is printed with the host's pace just before it (``bench.common.host_pace``): on
a shared host the same tree's ratio moves with it. ``--enqueue async`` starts a
batch's runs with concurrent ``aenqueue`` calls instead of one ``enqueue`` after
another.

    .venv/bin/python -m bench.async_steps [--reps 2] [--only "async c=100,async c=500"]
    .venv/bin/python -m bench.async_steps --reps 2 --enqueue async --only "async c=500"
    .venv/bin/python -m bench.async_steps --reps 1 --runs 20 --steps 2   # smoke test
    .venv/bin/python -m bench.async_steps --only "async c=500" --env FLEET_ASYNC_STRANDS=8

Workers load this module (``-A bench.async_steps``). No sweeper. One Redis database
(``--redis-db``, 14 by default). Figures printed and written to
``bench/out/async_steps.json``; nothing asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.common import host_pace, percentile, processes, save, services
from bench.io_bound import ENQUEUE, Batch, Config, batch_figures, run_batch
from bench.io_bound import report as io_report
from fleet import Fleet, RetryPolicy, Settings, StepContext, WorkflowContext
from fleet.testing import WORKER_READY, worker_argv

APP = "bench.async_steps"

fleet = Fleet("benchasync", default_retry=RetryPolicy(max_attempts=3, initial_delay=0.1))
celery_app = fleet.celery


@fleet.step
async def amodel_call(ctx: StepContext, i: int, seconds: float) -> int:
    """A stand-in for an async model call: ``seconds`` awaited on the process's loop."""
    await asyncio.sleep(seconds)
    return i


@fleet.workflow
def aagent(wf: WorkflowContext, steps: int, seconds: float) -> int:
    """An agent loop of ``steps`` async model calls, one after another."""
    for i in range(steps):
        wf.step(amodel_call, i, seconds)
    return steps


@dataclass(frozen=True)
class AsyncConfig(Config):
    """A threads-pool worker whose awaiting steps hold no slot, up to ``awaiting`` of them
    (``FLEET_ASYNC_AWAITING``; 0: each holds its slot's thread, as before strands)."""

    awaiting: int = 1000

    def limit(self, seconds: float) -> float:
        """Steps/s the worker allows: its slots and its room off them, capped by the runs."""
        return min((self.concurrency + self.awaiting) * self.processes, self.runs) / seconds


CONFIGS = (
    AsyncConfig("async c=100", "threads", 100, 100, 20),
    AsyncConfig("async c=200", "threads", 200, 200, 10),
    AsyncConfig("async c=500", "threads", 500, 500, 20),
    # Each awaiting step on its slot's thread: the figure before strands.
    AsyncConfig("async c=500 on slots", "threads", 500, 500, 20, awaiting=0),
    # The "thread pool of modest size": 500 awaiting on a worker of 8 slots.
    AsyncConfig("async 500 on 8 slots", "threads", 8, 500, 20),
)
TARGET = 0.9  # issue #20: of the limit at 500 concurrent steps in one process
DEFAULT = ("async c=100", "async c=200", "async c=500", "async 500 on 8 slots")


def peak_concurrency(attempts: list[Any]) -> int:
    """The most attempts running at one moment (by the store's clock)."""
    edges = sorted(
        [(a.started_at, 1) for a in attempts]
        + [(a.finished_at, -1) for a in attempts if a.finished_at is not None],
        key=lambda edge: (edge[0], edge[1]),  # an end before a start at the same instant
    )
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


PEAKS: dict[str, list[int]] = {}
PHASES: dict[str, list[dict[str, float]]] = {}


def phases(attempts: list[Any]) -> dict[str, float]:
    """Where a batch's wall goes, in seconds from its first run's creation: the last
    run's creation, the last run's first step, the runs' spans (first step's start to
    last step's end, median and most) and an attempt's length (median), the last end."""
    t0 = min(a.created_at for a in attempts)
    runs: dict[str, list[Any]] = {}
    for a in attempts:
        runs.setdefault(a.run_id, []).append(a)
    spans = [max(a.finished_at for a in r) - min(a.started_at for a in r) for r in runs.values()]
    return {
        "last_created_s": max(a.created_at for a in attempts) - t0,
        "last_first_step_s": max(min(a.started_at for a in r) for r in runs.values()) - t0,
        "run_span_p50_s": percentile(spans, 50),
        "run_span_max_s": max(spans),
        "attempt_p50_s": percentile([a.finished_at - a.started_at for a in attempts], 50),
        "last_end_s": max(a.finished_at for a in attempts) - t0,
    }


def measure(
    client: Fleet, cfg: Config, seconds: float, timeout: float, pids: list[int], how: str
) -> Batch:
    """One batch of ``cfg.runs`` runs enqueued at once (``how``: one after another, or
    all with ``aenqueue``), its figures from the store (and its peak of attempts running
    at once, kept in ``PEAKS``; where its wall went, its ratio and the host's pace just
    before it, in ``PHASES``)."""
    pace = host_pace()  # the worker idle: the host's pace, not the worker's load
    ids, enqueue_s, used = run_batch(client, cfg, seconds, timeout, pids, aagent, ENQUEUE[how])
    batch, attempts = batch_figures(client, cfg, seconds, ids, enqueue_s, used)
    PEAKS.setdefault(cfg.label, []).append(peak_concurrency(attempts))
    PHASES.setdefault(cfg.label, []).append(
        {**phases(attempts), "ratio": batch.ratio, "host_pace_ms": pace}
    )
    return batch


def run_config(
    cfg: AsyncConfig,
    reps: int,
    seconds: float,
    redis_db: int,
    how: str,
    worker_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A fresh store and worker for ``cfg``: a warm-up batch, then ``reps`` measured."""
    with services(f"async_{cfg.concurrency}", redis_db=redis_db) as svc:
        client = fleet.with_settings(Settings.from_env(svc.env()))
        client.upgrade_schema()
        argv = worker_argv(APP, cfg.concurrency, cfg.pool)
        env = {"FLEET_ASYNC_AWAITING": str(cfg.awaiting), **(worker_env or {})}
        with processes(svc, [("worker1", argv)], WORKER_READY, **env) as procs:
            pids = [p.pid for p in procs]
            small = replace(cfg, runs=min(20, cfg.runs), steps=1)
            warm = measure(client, small, seconds, 60, pids, how)
            timeout = cfg.steps * seconds * 20 + 60
            batches = [measure(client, cfg, seconds, timeout, pids, how) for _ in range(reps)]
    return {"config": asdict(cfg), "probe": asdict(warm), "batches": [asdict(b) for b in batches]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--runs", type=int, help="runs per batch, every configuration")
    p.add_argument("--steps", type=int, help="steps per run, every configuration")
    p.add_argument("--seconds", type=float, default=1.0, help="latency of one step")
    p.add_argument("--redis-db", type=int, default=14)
    labels = [c.label for c in CONFIGS]
    p.add_argument("--only", default=",".join(DEFAULT), help="labels: " + ", ".join(labels))
    p.add_argument(
        "--enqueue",
        choices=sorted(ENQUEUE),
        default="sync",
        help="the batch's runs enqueued one after another (sync) or at once (aenqueue)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the worker (FLEET_ASYNC_STRANDS=8, say); repeatable",
    )
    args = p.parse_args()
    worker_env = dict(e.partition("=")[::2] for e in args.env)
    configs = [
        replace(c, runs=args.runs or c.runs, steps=args.steps or c.steps)
        for c in CONFIGS
        if c.label in args.only.split(",")
    ]
    load = os.getloadavg()
    results = []
    for cfg in configs:
        print(f"{cfg.label}: {cfg.runs} runs x {cfg.steps} steps, {args.reps} rep(s)...")
        results.append(
            run_config(cfg, args.reps, args.seconds, args.redis_db, args.enqueue, worker_env)
        )
    summary = io_report(results, args.seconds, AsyncConfig, TARGET)
    print("peak attempts awaiting at once (warm-up, then each batch):")
    for label, peaks in PEAKS.items():
        print(f"  {label:<13} {peaks}")
    print(
        "each measured batch: its ratio, the host's pace before it (bench.common.host_pace, "
        "ms: more is slower), and where its wall goes, in s from its first run's creation"
    )
    for label, batches in PHASES.items():
        for ph in batches[1:]:  # the first is the warm-up
            print(
                f"  {label:<21} {ph['ratio']:.2f} at pace {ph['host_pace_ms']:.0f}: "
                f"last created {ph['last_created_s']:.2f}, its first step "
                f"{ph['last_first_step_s']:.2f}; a run spans {ph['run_span_p50_s']:.2f} "
                f"(most {ph['run_span_max_s']:.2f}), an attempt {ph['attempt_p50_s']:.3f}; "
                f"last end {ph['last_end_s']:.2f}"
            )
    path = save(
        "async_steps",
        {
            "seconds": args.seconds,
            "enqueue": args.enqueue,
            "loadavg_before": load,
            "loadavg_after": os.getloadavg(),
            "summary": summary,
            "peaks": PEAKS,
            "phases": PHASES,
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
