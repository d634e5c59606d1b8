"""Benchmark 6 of issue #7 — long runs: the cost of one step and of one advance at
step 10, 100, 1,000, 2,000 and 5,000 of one sequential run (issue #19: the last step
as cheap as the 10th).

    .venv/bin/python -m bench.long_runs [--steps 5000] [--reps 3] [--store sqlite postgres]
                                        [--live 256 0]

Steps are executed in this process (wake-ups kept in a list, no worker processes), so
the figure is the engine's own. At each mark: the ``--reps`` steps from there are
timed whole (lease, body, the commit with the advance that records the next step),
then ``--reps`` extra advances (load the run and its steps, replay or resume the
workflow, record nothing new). ``--warm N``: one earlier run of N steps first, then
(Postgres) ``ANALYZE``, so the plans are a used database's. ``--live``: the
FLEET_LIVE_RUNS values to compare, each a whole run (0: every advance replays the
workflow from the top).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from bench.common import save, services, spread
from fleet import Fleet, Settings
from fleet.worker.attempt import execute
from fleet.worker.replay import advance

MARKS = (10, 100, 1000, 2000, 5000)


@contextlib.contextmanager
def _database(store: str) -> Iterator[str]:
    if store == "postgres":
        with services("long") as svc:
            yield svc.database_url
    else:
        with tempfile.TemporaryDirectory(prefix="fleet-bench-long-") as folder:
            yield f"sqlite:///{folder}/fleet.db"


Timings = dict[int, list[float]]


def _warm(client: Fleet, broker: Any, steps: int) -> None:
    """A database that has seen work: one earlier run of ``steps`` steps, then the
    planner's statistics refreshed (Postgres), as autovacuum has done on any database
    older than a minute or so. A brand-new one has the statistics of empty tables: the
    planner may then look a step up by its run alone (``uq_steps_seq``) and filter the
    run's every row, a cost that grows with the run."""
    client.enqueue("chain", steps)
    while broker.sent:
        task, args = broker.sent.pop(0)
        if task == "fleet.advance":
            advance(client.runtime, args[0])
        else:
            execute(client.runtime, args[0], args[1])
    db = client.runtime.db
    if db.dialect == "postgresql":
        with db.engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE")
            conn.commit()


def measure(
    url: str, steps: int, reps: int, live_runs: int, warm: int = 0
) -> tuple[Timings, Timings, float]:
    """Milliseconds per step and per advance at each mark, and the whole run's seconds."""
    from tests import flows
    from tests.harness import InlineBroker

    broker_dir = tempfile.mkdtemp(prefix="fleet-bench-broker-")
    settings = Settings.from_env(
        {
            "FLEET_DATABASE_URL": url,
            "FLEET_BROKER_URL": f"filesystem:///{broker_dir}",
            "FLEET_LIVE_RUNS": str(live_runs),
        }
    )
    client = flows.fleet.with_settings(settings)
    client.upgrade_schema()
    broker = InlineBroker(client)
    if warm:
        _warm(client, broker, warm)
    run = client.enqueue("chain", steps + reps)  # the last mark times --reps steps too
    started = time.perf_counter()
    timings: Timings = {}
    step_ms: Timings = {}
    timed: list[float] | None = None  # the steps being timed from the last mark
    executed = 0
    while broker.sent:
        task, args = broker.sent.pop(0)
        if task == "fleet.advance":
            advance(client.runtime, args[0])
            continue
        executed += 1
        if executed in MARKS:
            timings[executed] = []
            for _ in range(reps):  # extra advances at this point, timed; they record nothing
                t0 = time.perf_counter()
                advance(client.runtime, args[0])
                timings[executed].append((time.perf_counter() - t0) * 1000)
            timed = step_ms[executed] = []
        t0 = time.perf_counter()
        execute(client.runtime, args[0], args[1])
        if timed is not None:
            timed.append((time.perf_counter() - t0) * 1000)
            if len(timed) == reps:
                timed = None
    assert run.status() == "succeeded", run.status()
    return step_ms, timings, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--store", nargs="+", default=["sqlite", "postgres"])
    p.add_argument("--live", nargs="+", type=int, default=[256, 0])
    p.add_argument("--warm", type=int, default=0, help="steps of an earlier run first")
    a = p.parse_args()
    results: dict[str, dict[str, object]] = {}
    for store in a.store:
        for live_runs in a.live:
            with _database(store) as url:
                steps, timings, total = measure(url, a.steps, a.reps, live_runs, a.warm)
            results[f"{store} live={live_runs}"] = {
                "ms_per_step": {str(k): v for k, v in steps.items()},
                "ms_per_advance": {str(k): v for k, v in timings.items()},
                "run_s": total,
            }
            print(
                f"{store}, FLEET_LIVE_RUNS={live_runs}: one run of {a.steps} steps "
                f"in {total:.1f}s (in process)"
            )
            for mark, ms in timings.items():
                print(
                    f"  at step {mark:>5}: a step {spread(steps[mark])} ms, "
                    f"an advance {spread(ms)} ms"
                )
    save("long_runs", {"steps": a.steps, "reps": a.reps, "runs": results})


if __name__ == "__main__":
    main()
