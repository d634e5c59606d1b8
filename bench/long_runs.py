"""Benchmark 6 of issue #7 (a first cut): the cost of one advance (a replay over the
recorded history) at step 10, 100, 1,000 … of one sequential run.

    .venv/bin/python bench/long_runs.py sqlite:////tmp/fleet-bench.db 1000
    .venv/bin/python bench/long_runs.py postgresql+psycopg://postgres@127.0.0.1/fleet_bench 2000

Steps are executed in this process (no broker, no worker processes), so the figure is
the engine's own: load the run and its steps, replay the workflow, record nothing new.
The database must exist (it is migrated here) and should be empty.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleet import Settings  # noqa: E402
from fleet.attempt import execute  # noqa: E402
from fleet.replay import advance  # noqa: E402
from tests import flows  # noqa: E402
from tests.harness import InlineBroker  # noqa: E402

MARKS = (10, 100, 1000, 2000, 5000)


def main(url: str, steps: int) -> None:
    broker_dir = tempfile.mkdtemp(prefix="fleet-bench-broker-")
    settings = Settings.from_env(
        {"FLEET_DATABASE_URL": url, "FLEET_BROKER_URL": f"filesystem:///{broker_dir}"}
    )
    client = flows.fleet.with_settings(settings)
    client.upgrade_schema()
    broker = InlineBroker(client)
    run = client.enqueue("chain", steps)
    started = time.perf_counter()
    timings: dict[int, float] = {}
    executed = 0
    while broker.sent:
        task, args = broker.sent.pop(0)
        if task == "fleet.advance":
            advance(client.runtime, args[0])
            continue
        executed += 1
        if executed in MARKS:
            t0 = time.perf_counter()
            advance(client.runtime, args[0])  # an extra replay at this point, timed
            timings[executed] = (time.perf_counter() - t0) * 1000
        execute(client.runtime, args[0], args[1])
    total = time.perf_counter() - started
    print(f"run {run.status()} with {steps} steps in {total:.1f} s on {url.split(':')[0]}")
    for mark, ms in timings.items():
        print(f"  advance at step {mark:>5}: {ms:7.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
