"""Benchmark 4 of issue #7 — recovery: the time from SIGKILL of the worker running a
step to that step running again on another worker, for several lease settings.

    .venv/bin/python -m bench.recovery [--reps 5] [--leases 2 5 10]

Two workers and a sweeper (interval 0.5 s, grace 1 s) on Postgres + Redis. A one-step
run's first attempt holds for ten minutes; the harness kills its worker (SIGKILL, whole
process group) as soon as the step has started, starts a replacement, and reads the
next attempt's start time from the step log (outside the store). The kill lands just
after the lease was taken, so the lease has nearly all its time left (the worst case;
a kill later in the heartbeat cycle recovers up to a third of a lease sooner). Once
the lease has expired, the sweeper's next tick re-sends the step: no grace applies.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from typing import Any

from bench.common import Services, processes, save, services, spread, wait_until
from fleet import Settings
from fleet.testing import SWEEPER_READY, WORKER_READY, FleetProcess, sweeper_argv, worker_argv

APP = "tests.flows"
SWEEP_INTERVAL, SWEEP_GRACE = 0.5, 1.0


def _starts(log: Path, run_id: str) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    events = (json.loads(line) for line in log.read_text().splitlines() if line.strip())
    return [e for e in events if e["run"] == run_id and e["event"] == "start"]


def _worker(svc: Services, name: str, env: dict[str, str]) -> FleetProcess:
    proc = FleetProcess(
        name, worker_argv(APP, 2), svc.env(FLEET_WORKER_NAME=name, **env), svc.workdir
    )
    if not proc.wait_for_output(WORKER_READY, 60):
        raise RuntimeError(f"{name} did not start:\n{proc.output()[-2000:]}")
    return proc


def measure(lease: float, reps: int) -> list[float]:
    """Seconds from each kill to the interrupted step's next start."""
    out: list[float] = []
    with services("recovery", redis_db=14) as svc:
        log = svc.workdir / "steps.jsonl"
        env = {
            "FLEET_LEASE_SECONDS": str(lease),
            "FLEET_SWEEP_INTERVAL": str(SWEEP_INTERVAL),
            "FLEET_SWEEP_GRACE": str(SWEEP_GRACE),
            "FLEET_TEST_LOG": str(log),
        }
        from tests import flows

        client = flows.fleet.with_settings(Settings.from_env(svc.env(**env)))
        client.upgrade_schema()
        with processes(svc, [("sweeper", sweeper_argv(APP))], SWEEPER_READY, **env):
            workers = [_worker(svc, f"w{i}", env) for i in range(2)]
            try:
                for rep in range(reps):
                    run = client.enqueue("chain", 1, 0.0, 0, 600.0)
                    first = wait_until(lambda r=run.id: _starts(log, r), 60, "the first attempt")
                    victim = next(w for w in workers if w.pid == first[0]["pid"])
                    victim.signal(signal.SIGKILL)
                    killed_at = time.time()
                    victim.stop()
                    again = wait_until(
                        lambda r=run.id: _starts(log, r)[1:], 10 * lease + 60, "the second attempt"
                    )
                    out.append(again[0]["t"] - killed_at)
                    print(f"  lease {lease:>4}s, kill {rep + 1}: step again after {out[-1]:.2f}s")
                    workers[workers.index(victim)] = _worker(svc, f"w{rep}-again", env)
                    run.wait(timeout=60)
            finally:
                for w in workers:
                    w.signal(signal.SIGKILL)
                    w.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--leases", type=float, nargs="+", default=[2.0, 5.0, 10.0])
    a = p.parse_args()
    rows = {}
    for lease in a.leases:
        seconds = measure(lease, a.reps)
        rows[str(lease)] = {
            "seconds": seconds,
            "median": sorted(seconds)[len(seconds) // 2],
            "max": max(seconds),
            "over_lease": [round(s / lease, 2) for s in seconds],
        }
    print("\nrecovery: SIGKILL → the interrupted step running again")
    print(
        f"  sweeper interval {SWEEP_INTERVAL}s, grace {SWEEP_GRACE}s;"
        " bound ≈ lease + interval + delivery"
    )
    for lease, row in rows.items():
        bound = float(lease) + SWEEP_INTERVAL
        print(
            f"  lease {lease:>5}s: {spread(row['seconds'], '{:.2f}')} s;"
            f" max {row['max']:.2f}s (bound {bound:.1f}s)"
        )
    default = Settings()
    print(
        f"  defaults: lease {default.lease_seconds}s, interval {default.sweep_interval}s,"
        f" → at most ≈ {default.lease_seconds + default.sweep_interval:.0f}s after a kill"
    )
    save("recovery", {"sweep_interval": SWEEP_INTERVAL, "sweep_grace": SWEEP_GRACE, "leases": rows})


if __name__ == "__main__":
    main()
