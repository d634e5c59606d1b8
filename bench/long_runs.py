"""Benchmark 6 of issue #7 — long runs: the cost of one advance (a replay over the
recorded history) at step 10, 100, 1,000 and 5,000 of one sequential run.

    .venv/bin/python -m bench.long_runs [--steps 5000] [--reps 3] [--store sqlite postgres]

Steps are executed in this process (wake-ups kept in a list, no worker processes), so
the figure is the engine's own: load the run and its steps, replay the workflow,
record nothing new. At each mark the replay is timed ``--reps`` times.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator

from bench.common import save, services, spread
from fleet import Settings
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


def measure(url: str, steps: int, reps: int) -> tuple[dict[int, list[float]], float]:
    """Milliseconds per advance at each mark, and the whole run's seconds."""
    from tests import flows
    from tests.harness import InlineBroker

    broker_dir = tempfile.mkdtemp(prefix="fleet-bench-broker-")
    settings = Settings.from_env(
        {"FLEET_DATABASE_URL": url, "FLEET_BROKER_URL": f"filesystem:///{broker_dir}"}
    )
    client = flows.fleet.with_settings(settings)
    client.upgrade_schema()
    broker = InlineBroker(client)
    run = client.enqueue("chain", steps)
    started = time.perf_counter()
    timings: dict[int, list[float]] = {}
    executed = 0
    while broker.sent:
        task, args = broker.sent.pop(0)
        if task == "fleet.advance":
            advance(client.runtime, args[0])
            continue
        executed += 1
        if executed in MARKS:
            timings[executed] = []
            for _ in range(reps):  # extra replays at this point, timed; they record nothing
                t0 = time.perf_counter()
                advance(client.runtime, args[0])
                timings[executed].append((time.perf_counter() - t0) * 1000)
        execute(client.runtime, args[0], args[1])
    assert run.status() == "succeeded", run.status()
    return timings, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--store", nargs="+", default=["sqlite", "postgres"])
    a = p.parse_args()
    results = {}
    for store in a.store:
        with _database(store) as url:
            timings, total = measure(url, a.steps, a.reps)
        results[store] = {"ms_per_advance": {str(k): v for k, v in timings.items()}, "run_s": total}
        print(f"{store}: one run of {a.steps} steps in {total:.1f}s (in process)")
        for mark, ms in timings.items():
            print(f"  advance at step {mark:>5}: {spread(ms)} ms")
    save("long_runs", {"steps": a.steps, "reps": a.reps, "stores": results})


if __name__ == "__main__":
    main()
