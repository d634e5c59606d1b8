"""What every benchmark shares: a fresh Postgres database and Redis database on the
local services, worker subprocesses, repetition statistics and the machine's facts.

Benchmarks print their figures; nothing here asserts a time."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from fleet.testing import FleetProcess
from tests.harness import wait_until

__all__ = ["wait_until"]

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_BENCH_DB = 12
OUT = ROOT / "bench" / "out"


@dataclass
class Services:
    """One throwaway Postgres database and one emptied Redis database."""

    database_url: str
    broker_url: str
    redis_db: int
    workdir: Path
    _drop: list[Callable[[], None]] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a worker or sweeper subprocess on these services."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env.update(
            FLEET_DATABASE_URL=self.database_url,
            FLEET_BROKER_URL=self.broker_url,
            PYTHONPATH=str(ROOT),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    @property
    def libpq_url(self) -> str:
        """The database's URL as psycopg itself takes it (without SQLAlchemy's driver)."""
        return self.database_url.replace("postgresql+psycopg://", "postgresql://")

    def redis(self) -> Any:
        import redis

        return redis.Redis("127.0.0.1", 6379, db=self.redis_db)


@contextlib.contextmanager
def services(tag: str, redis_db: int = REDIS_BENCH_DB) -> Iterator[Services]:
    """A fresh database ``fleet_bench_<tag>_<random>`` and Redis DB ``redis_db``, flushed;
    the database is dropped on exit."""
    import psycopg

    name = f"fleet_bench_{tag}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    workdir = OUT / "work" / name
    workdir.mkdir(parents=True, exist_ok=True)
    svc = Services(
        f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}",
        f"redis://127.0.0.1:6379/{redis_db}",
        redis_db,
        workdir,
    )
    svc.redis().flushdb()
    try:
        yield svc
    finally:
        svc.redis().flushdb()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def processes(
    svc: Services,
    argvs: list[tuple[str, list[str]]],
    ready: str,
    timeout: float = 60.0,
    module: str = "fleet",
    **env: str,
) -> Iterator[list[Any]]:
    """Start ``python -m MODULE ARGV`` (fleet by default) for each (name, argv) and wait for
    ``ready`` in its log; every one is killed on exit."""
    procs = []
    try:
        for name, argv in argvs:
            procs.append(
                FleetProcess(
                    name,
                    argv,
                    svc.env(FLEET_WORKER_NAME=name, **env),
                    svc.workdir,
                    module=module,
                )
            )
        for proc in procs:
            if not proc.wait_for_output(ready, timeout):
                raise RuntimeError(f"{proc.name} did not start:\n{proc.output()[-3000:]}")
        yield procs
    finally:
        for proc in procs:
            proc.signal(9)
            proc.stop()


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """``median (min–max, n=N)`` of repeated measurements."""
    if not values:
        return "n/a"
    med = statistics.median(values)
    return (
        f"{fmt.format(med)} ({fmt.format(min(values))}–{fmt.format(max(values))}, n={len(values)})"
    )


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def _cmd(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not found"


def host_pace(additions: int = 3_000_000) -> float:
    """Milliseconds this interpreter takes to add up ``additions`` integers in a plain
    loop, now: the pace of a shared host at this moment. The same machine's figures
    move with it (on the 2-core host of bench/RESULTS.md the same loop has taken twice
    as long at one moment as at another half an hour before), so a benchmark prints it
    beside each batch and a reader can tell a slow minute from a change."""
    start = time.perf_counter()
    total = 0
    for i in range(additions):
        total += i
    return (time.perf_counter() - start) * 1000


def machine() -> dict[str, Any]:
    """The facts a reader needs to compare figures: CPU, cores, versions."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for dist in ("fleet", "celery", "kombu", "redis", "SQLAlchemy", "psycopg", "dbos", "gevent"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "postgres": _cmd(
            ["psql", "-h", "127.0.0.1", "-U", "postgres", "-tAc", "show server_version"]
        ),
        "redis": _cmd(["redis-server", "--version"]).split(" sha=")[0],
        "packages": versions,
    }


def save(name: str, result: dict[str, Any]) -> Path:
    """Write ``bench/out/<name>.json`` (machine facts + figures) and return its path."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    payload = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        **result,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def pg_counters(database: str) -> dict[str, int]:
    """Cumulative counters of one database from ``pg_stat_database``, read from the admin
    database (so reading adds nothing to them), plus the cluster's next transaction id:
    ids are assigned only to transactions that write, so its delta counts write
    transactions of the whole cluster (exact only while nobody else writes: see
    ``others_active``). A backend reports its counters when it exits or after idling;
    see ``settled_pg_counters``."""
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted,"
            " numbackends FROM pg_stat_database WHERE datname = %s",
            (database,),
        ).fetchone()
        # The next id to be assigned, read without taking one.
        xid = conn.execute(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
        ).fetchone()
    assert row is not None and xid is not None
    keys = ("commits", "rollbacks", "inserted", "updated", "deleted", "backends")
    return {**dict(zip(keys, map(int, row), strict=True)), "xid": int(xid[0])}


def pg_xacts_by_database() -> dict[str, int]:
    """Transactions so far (commits + rollbacks) of every database but the admin one."""
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT datname, xact_commit + xact_rollback FROM pg_stat_database"
            " WHERE datname IS NOT NULL AND datname <> 'postgres'"
        ).fetchall()
    return {str(name): int(n) for name, n in rows}


def others_active(before: dict[str, int], after: dict[str, int], ours: str) -> int:
    """Transactions other databases ran between two ``pg_xacts_by_database`` readings
    (databases dropped meanwhile are not seen): 0 means the cluster was ours."""
    return sum(max(0, n - before.get(name, 0)) for name, n in after.items() if name != ours)


def settled_pg_counters(database: str, timeout: float = 15.0) -> dict[str, int]:
    """``pg_counters`` once no backend is connected to ``database`` and two reads 0.3 s
    apart agree (an exiting backend flushes its counters as it goes)."""
    last: dict[str, int] = {}

    def stable() -> dict[str, int] | None:
        nonlocal last
        now = pg_counters(database)
        same = bool(last) and all(now[k] == last[k] for k in ("commits", "rollbacks", "updated"))
        last = now
        return now if same and now["backends"] == 0 else None

    settled = wait_until(stable, timeout, f"statistics of {database} to settle", interval=0.3)
    assert settled is not None
    return settled


def redis_calls() -> dict[str, int]:
    """Calls per command since the Redis server started (``INFO commandstats``). The server
    is shared: every database and every client counts, so take deltas over a quiet window."""
    import redis

    stats = redis.Redis("127.0.0.1", 6379).info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """``after - before`` per key (keys missing from ``before`` count from zero)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
