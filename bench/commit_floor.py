"""What one durable commit costs this machine's Postgres, with nothing of fleet in it:
the floor under a step's share of the server (bench/RESULTS.md, "Many runs").

On a scratch database, one connection runs N transactions, each sent in one round
trip (psycopg's pipeline: BEGIN, the statements, COMMIT), of three shapes:

- ``commit``: one row updated (the least a durable checkpoint writes);
- ``insert``: one row inserted into a table with three indexes (a step's record);
- ``step-shaped``: what a fleet step's transaction writes, in plain statements: a
  row of a three-index table updated twice and one inserted, an attempt row updated
  and one inserted, the run's row updated twice, and the run's history read.

For each it prints the wall time per transaction and the CPU per transaction of the
machine and of Postgres (its backends, WAL writer and the rest, from /proc).

    .venv/bin/python -m bench.commit_floor [--n 3000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import psycopg

from bench.common import services
from bench.cpu import CpuMeter

_SCHEMA = """
CREATE TABLE one (id int PRIMARY KEY, n bigint NOT NULL);
INSERT INTO one VALUES (1, 0);
CREATE TABLE runs (id text PRIMARY KEY, status text NOT NULL, seq bigint NOT NULL,
                   advanced bigint NOT NULL, updated double precision NOT NULL);
CREATE INDEX ON runs (status);
INSERT INTO runs VALUES ('r', 'running', 0, 0, 0);
CREATE TABLE steps (run_id text NOT NULL REFERENCES runs (id), step_id text NOT NULL,
                    seq int NOT NULL, status text NOT NULL, input text NOT NULL,
                    output text, epoch int NOT NULL DEFAULT 0, lease text,
                    PRIMARY KEY (run_id, step_id), UNIQUE (run_id, seq));
CREATE INDEX ON steps (status);
CREATE TABLE attempts (run_id text NOT NULL, step_id text NOT NULL, epoch int NOT NULL,
                       outcome text NOT NULL, PRIMARY KEY (run_id, step_id, epoch));
"""

Shape = Callable[[psycopg.Connection, int], None]


def _commit(conn: psycopg.Connection, i: int) -> None:
    conn.execute("UPDATE one SET n = n + 1 WHERE id = 1")


def _insert(conn: psycopg.Connection, i: int) -> None:
    conn.execute(
        "INSERT INTO steps (run_id, step_id, seq, status, input) VALUES ('r', %s, %s, 'p', '[]')",
        (f"s{i}", i),
    )


def _step_shaped(conn: psycopg.Connection, i: int) -> None:
    run, prev, step = f"r{i // 10}", f"s{i - 1}", f"s{i}"
    if i % 10 == 0:
        conn.execute("INSERT INTO runs VALUES (%s, 'running', 0, 0, 0)", (run,))
    else:
        conn.execute(
            "UPDATE steps SET status = 'done', output = '1' WHERE run_id = %s AND step_id = %s",
            (run, prev),
        )
        conn.execute(
            "UPDATE attempts SET outcome = 'done' WHERE run_id = %s AND step_id = %s",
            (run, prev),
        )
        conn.execute("UPDATE runs SET seq = seq + 1, updated = 1 WHERE id = %s", (run,))
    conn.execute(
        "INSERT INTO steps (run_id, step_id, seq, status, input) VALUES (%s, %s, %s, 'p', '[]')",
        (run, step, i),
    )
    conn.execute("UPDATE runs SET advanced = seq WHERE id = %s", (run,))
    conn.execute(
        "UPDATE steps SET status = 'running', epoch = epoch + 1, lease = 'w' "
        "WHERE run_id = %s AND step_id = %s",
        (run, step),
    )
    conn.execute("INSERT INTO attempts VALUES (%s, %s, 1, 'running')", (run, step))
    conn.execute("SELECT step_id, output FROM steps WHERE run_id = %s ORDER BY seq", (run,))


SHAPES: dict[str, Shape] = {"commit": _commit, "insert": _insert, "step-shaped": _step_shaped}


def _measure(url: str, shape: Shape, n: int) -> tuple[float, dict[str, float]]:
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(50):  # warm: the statements prepared, the caches filled
            _one(conn, shape, -1000 - i * 10)
        meter = CpuMeter().start()
        t0 = time.perf_counter()
        for i in range(n):
            _one(conn, shape, i)
        wall = time.perf_counter() - t0
        meter.stop()
    return wall * 1000 / n, meter.per_unit_ms(n)


def _one(conn: psycopg.Connection, shape: Shape, i: int) -> None:
    with conn.pipeline():
        conn.execute("BEGIN")
        shape(conn, i)
        conn.execute("COMMIT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="transactions per shape")
    args = parser.parse_args()
    with services("floor") as svc:
        url = svc.libpq_url
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(_SCHEMA)
        print(f"commit floor: {args.n} transactions per shape, one round trip each")
        print(f"  {'shape':<12} {'wall ms':>8} {'machine CPU ms':>15} {'Postgres CPU ms':>16}")
        for name, shape in SHAPES.items():
            wall, cpu = _measure(url, shape, args.n)
            print(
                f"  {name:<12} {wall:8.3f} {cpu['machine']:15.3f} {cpu.get('postgres', 0.0):16.3f}"
            )


if __name__ == "__main__":
    main()
