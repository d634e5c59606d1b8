"""The DBOS Transact baseline: one workflow of ``n`` no-op ``@DBOS.step()``s, its system
database on the local Postgres. DBOS is a process-wide singleton, so each measurement
runs in a fresh process:

    python -m bench.dbos_flows postgresql://postgres@127.0.0.1:5432/DB 500

prints one JSON line, ``{"steps": n, "seconds": s}``: from ``start_workflow`` until
its result is back (DBOS's launch and migrations are not timed)."""

from __future__ import annotations

import json
import sys
import time

from dbos import DBOS, DBOSConfig


@DBOS.step()
def noop(i: int) -> int:
    """Does nothing; returns its argument."""
    return i


@DBOS.workflow()
def seq(n: int) -> int:
    """``n`` sequential no-op steps."""
    for i in range(n):
        noop(i)
    return n


def measure(database_url: str, steps: int) -> float:
    """Launch DBOS on ``database_url`` and time one ``seq(steps)`` run."""
    config: DBOSConfig = {
        "name": "fleet-bench",
        "system_database_url": database_url.replace("postgresql+psycopg://", "postgresql://"),
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.launch()
    try:
        started = time.perf_counter()
        handle = DBOS.start_workflow(seq, steps)
        if handle.get_result() != steps:
            raise RuntimeError("the DBOS workflow returned the wrong result")
        return time.perf_counter() - started
    finally:
        DBOS.destroy()


if __name__ == "__main__":
    n = int(sys.argv[2])
    print(json.dumps({"steps": n, "seconds": measure(sys.argv[1], n)}), flush=True)
