"""Subagents (issue #16): a parent run with 20 child runs of 10 no-op steps each, against
the same 200 steps as 20 independent runs, on 2 fleet worker processes (Postgres +
Redis). Timed on the store's clock: the parent from its creation to its finish; the
independent runs from the first one's creation to the last one's finish.

    .venv/bin/python -m bench.children [--reps 3] [--children 20]

A measurement, never a test: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from sqlalchemy import select

from bench import child_flows
from bench.common import save, services, spread
from bench.drivers import POOLS, RunClock, fleet_client, fleet_workers
from fleet import Fleet
from fleet.store.schema import runs

APP = "bench.child_flows"
WORKERS = 2
TARGET = 1.2  # parent time / independent runs' time, at most


def child_statuses(client: Fleet, parent_id: str) -> list[str]:
    """The statuses of the parent's child runs (each child once: none started twice)."""
    with client.runtime.db.begin() as conn:
        stmt = select(runs.c.status).where(runs.c.parent_id == parent_id)
        return [str(s) for s in conn.execute(stmt).scalars()]


def measure(children: int, concurrency: int, pool: str) -> dict[str, float]:
    """Seconds for the parent with ``children`` children, and for as many independent runs."""
    out: dict[str, float] = {}
    for shape in ("independent", "parent"):
        with services(f"kids{shape[:3]}") as svc:
            client = fleet_client(svc, child_flows.fleet)
            clock = RunClock(svc)
            with fleet_workers(svc, WORKERS, concurrency, pool, APP):
                if shape == "parent":
                    run = client.enqueue("parent", children)
                    out[shape] = clock.wait([run.id], timeout=300)
                    kids = child_statuses(client, run.id)
                    if kids != ["succeeded"] * children:
                        raise RuntimeError(f"child runs {kids}, expected {children} succeeded")
                else:
                    ids = [client.enqueue("ten").id for _ in range(children)]
                    out[shape] = clock.wait(ids, timeout=300)
            clock.close()
            client.runtime.db.dispose()
    out["ratio"] = out["parent"] / out["independent"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--children", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool", choices=POOLS, default="threads")
    args = parser.parse_args()
    print(
        f"children: a parent with {args.children} children x 10 no-op steps vs "
        f"{args.children} independent runs, {WORKERS} workers (--pool {args.pool} "
        f"--concurrency {args.concurrency}), {args.reps} rep(s)"
    )
    reps: list[dict[str, Any]] = []
    for i in range(args.reps):
        reps.append(measure(args.children, args.concurrency, args.pool))
        r = reps[-1]
        print(
            f"  rep {i + 1}: parent {r['parent']:.2f} s, independent {r['independent']:.2f} s, "
            f"ratio {r['ratio']:.2f}",
            flush=True,
        )
    ratios = [r["ratio"] for r in reps]
    ok = statistics.median(ratios) <= TARGET
    print(
        f"  parent/independent {spread(ratios, '{:.2f}')}  target <= {TARGET}: "
        f"{'met' if ok else 'MISSED'}"
    )
    summary = {k: spread([r[k] for r in reps], "{:.3f}") for k in reps[0]}
    path = save(
        "children", {"params": vars(args), "target": TARGET, "summary": summary, "reps": reps}
    )
    print(f"  saved {path}")


if __name__ == "__main__":
    main()
