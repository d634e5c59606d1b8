"""Fan-outs that scale linearly (issue #16): one run's ``wf.map`` of N no-op steps
against N single-step runs, on 2 fleet worker processes (Postgres + Redis). Timed on
the store's clock, from the first run's creation (its enqueue) to the last one's finish.
The workers are given FLEET_MAX_FANOUT and FLEET_MAX_STEPS above N, so 100,000 items
can be tried.

    .venv/bin/python -m bench.fanout [--items 10000] [--reps 1]

This module is also the fleet application the workers load (``-A bench.fanout``). A
measurement, never a test: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.common import save, services, spread
from bench.drivers import POOLS, RunClock, fleet_client, fleet_workers
from fleet import Fleet
from fleet.worker.context import StepContext
from fleet.worker.workflow import WorkflowContext

fleet = Fleet("benchfan")
APP = "bench.fanout"
WORKERS = 2
TARGET = 1.0  # map time / single-step runs' time, at most (issue 51: it was 0.44 at 0544c51)
REDIS_DB = 13  # not the other benchmarks' (12): they may run beside this one
LIMITS = {"FLEET_MAX_FANOUT": "200000", "FLEET_MAX_STEPS": "300000"}


@fleet.step
def noop(ctx: StepContext, i: int) -> int:
    """Does nothing; returns its argument so the replay has a value to hand back."""
    return i


@fleet.workflow
def spread_out(wf: WorkflowContext, items: int) -> int:
    """One fan-out of ``items`` no-op steps."""
    return len(wf.map(noop, range(items)))


@fleet.workflow
def single(wf: WorkflowContext, i: int) -> int:
    """One no-op step: the unit the fan-out is compared with."""
    return int(wf.step(noop, i))


def measure(items: int, concurrency: int, pool: str) -> dict[str, float]:
    """Seconds for one map of ``items`` and for as many single-step runs."""
    out: dict[str, float] = {}
    timeout = max(300.0, items * 0.1)
    for shape in ("single", "map"):
        with services(f"fan{shape[:3]}", redis_db=REDIS_DB) as svc:
            client = fleet_client(svc, fleet, **LIMITS)
            clock = RunClock(svc)
            with fleet_workers(svc, WORKERS, concurrency, pool, APP, **LIMITS):
                if shape == "map":
                    ids = [client.enqueue("spread_out", items).id]
                else:
                    ids = [client.enqueue("single", i).id for i in range(items)]
                out[shape] = clock.wait(ids, timeout=timeout)
            clock.close()
            client.runtime.db.dispose()
    out["ratio"] = out["map"] / out["single"]
    out["map_per_item_ms"] = out["map"] / items * 1000
    out["single_per_item_ms"] = out["single"] / items * 1000
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool", choices=POOLS, default="threads")
    args = parser.parse_args()
    print(
        f"fanout: a map of {args.items} no-op steps vs {args.items} single-step runs, "
        f"{WORKERS} workers (--pool {args.pool} --concurrency {args.concurrency}), "
        f"{args.reps} rep(s)"
    )
    reps: list[dict[str, Any]] = []
    for i in range(args.reps):
        reps.append(measure(args.items, args.concurrency, args.pool))
        r = reps[-1]
        print(
            f"  rep {i + 1}: map {r['map']:.2f} s ({r['map_per_item_ms']:.2f} ms/item), "
            f"single runs {r['single']:.2f} s ({r['single_per_item_ms']:.2f} ms/item), "
            f"ratio {r['ratio']:.2f}",
            flush=True,
        )
    ratios = [r["ratio"] for r in reps]
    ok = statistics.median(ratios) <= TARGET
    print(
        f"  map/single {spread(ratios, '{:.2f}')}  target <= {TARGET}: {'met' if ok else 'MISSED'}"
    )
    summary = {k: spread([r[k] for r in reps], "{:.3f}") for k in reps[0]}
    path = save(
        f"fanout_{args.items}",
        {"params": vars(args), "target": TARGET, "summary": summary, "reps": reps},
    )
    print(f"  saved {path}")


if __name__ == "__main__":
    main()
