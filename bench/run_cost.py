"""What a whole short run costs, start to end: R runs of the ``ten`` workflow (10 no-op
steps) and R of ``seq(1)`` (one step), each enqueued and driven to its end in this
process (``tests.harness.InlineBroker``: no broker, no Celery, no worker), on a fresh
Postgres database.

Per run: transactions, statements (as SQLAlchemy's listeners see them), wall time,
this process's CPU and Postgres's (its backends, WAL writer and the rest, from /proc);
with ``--trips``, round trips to the server from libpq's trace (which slows every
statement: the times are then not comparable). It is the cost bench.many_runs pays per
run on top of its steps, without the Celery consumer's.

    .venv/bin/python -m bench.run_cost [--runs 200] [--trips]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

from bench.common import services
from bench.cpu import CpuMeter
from bench.profile_steps import Meter, _client, _deliver
from fleet import Fleet
from tests.harness import Wire


def _measure(
    client: Fleet,
    sent: list[tuple[str, list[str]]],
    meter: Meter,
    enqueue: Callable[[], object],
    runs: int,
    trips: bool,
) -> dict[str, float]:
    for _ in range(5):  # warm: the statements prepared, the caches filled
        enqueue()
    _deliver(client, sent, meter)
    meter.reset()
    wire = Wire()
    if trips:
        wire.start()
    cpu = CpuMeter().start()
    t0, own0 = time.perf_counter(), time.process_time()
    for _ in range(runs):
        enqueue()
        _deliver(client, sent, meter)
    wall, own = time.perf_counter() - t0, time.process_time() - own0
    cpu.stop()
    shares = cpu.per_unit_ms(runs)
    out = {
        "xacts": sum(meter.xacts.values()) / runs,
        "statements": sum(meter.statements.values()) / runs,
        "wall ms": wall * 1000 / runs,
        "own CPU ms": own * 1000 / runs,
        "Postgres CPU ms": shares.get("postgres", 0.0),
    }
    if trips:
        out["round trips"] = wire.stop() / runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs of each shape")
    parser.add_argument(
        "--trips", action="store_true", help="count round trips (libpq's trace: slower)"
    )
    args = parser.parse_args()
    meter = Meter()
    with services("runcost") as svc:
        client, sent = _client(svc.database_url)
        meter.listen()
        shapes: dict[str, Callable[[], object]] = {
            "ten (10 steps)": partial(client.enqueue, "ten"),
            "seq(1) (1 step)": partial(client.enqueue, "seq", 1),
        }
        print(f"run cost: {args.runs} runs of each shape, in process on Postgres, per run")
        rows = {
            name: _measure(client, sent, meter, enqueue, args.runs, args.trips)
            for name, enqueue in shapes.items()
        }
    columns = list(next(iter(rows.values())))
    print(f"  {'':<18}" + "".join(f"{c:>16}" for c in columns))
    for name, row in rows.items():
        print(f"  {name:<18}" + "".join(f"{row[c]:16.2f}" for c in columns))


if __name__ == "__main__":
    main()
