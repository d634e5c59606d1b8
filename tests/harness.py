"""Test harness: backends (SQLite + filesystem, Postgres + Redis), real worker and
sweeper subprocesses, and polling with deadlines (never sleep-and-hope). The
in-process broker is the public one users import (``fleet.testing.InlineBroker``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fleet import Fleet, Settings
from fleet.testing import SWEEPER_READY, WORKER_READY, FleetProcess, sweeper_argv, worker_argv
from fleet.testing import InlineBroker as InlineBroker  # the tests import it from here
from tests.chaos import mutants

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
# The suite FLUSHDBs its Redis database. TEST_REDIS_DB lets two checkouts run at once;
# each pytest-xdist worker (gw0, gw1, gw2) takes the next database (9, 10, 11). Flower's
# and the deploy tests keep databases of their own (14, 15): a worker's events on
# Flower's database would reach Flower's metrics.
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
REDIS_DB = int(os.environ.get("TEST_REDIS_DB", "9")) + int(
    os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0
)
APP = "tests.flows"
T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Call ``check`` until it returns something truthy; TimeoutError naming ``what``
    at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def together(n: int, call: Callable[[], T], timeout: float = 60) -> list[T | Exception]:
    """``call`` from ``n`` threads released at once (a race, on purpose): each call's
    result, or the ``Exception`` it raised, in the order they finished."""
    results: list[T | Exception] = []
    start = threading.Barrier(n)

    def one() -> None:
        start.wait(timeout=timeout)
        try:
            results.append(call())
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results


def poll(check: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """``wait_until``, failing the test at the deadline."""
    try:
        return wait_until(check, timeout, what, interval)
    except TimeoutError as exc:
        pytest.fail(str(exc))


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_services() -> None:
    """Postgres and Redis must be up: skip on a laptop without them, fail in CI."""
    missing = [
        name
        for name, port in (("Postgres", 5432), ("Redis", REDIS_PORT))
        if not _reachable("127.0.0.1", port)
    ]
    if missing:
        message = f"{' and '.join(missing)} unreachable on 127.0.0.1"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message + " (CI=true: services are required)", pytrace=False)
        pytest.skip(message)


@dataclass
class Backend:
    """One store + broker pair and a scratch folder for the test's processes."""

    kind: str
    workdir: Path
    database_url: str
    broker_url: str
    lease_seconds: float = 2.0
    extra_env: dict[str, str] = field(default_factory=dict)
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.workdir / "executions.jsonl"

    @property
    def provider_path(self) -> Path:
        return self.workdir / "provider.jsonl"

    @property
    def hook_log_path(self) -> Path:
        return self.workdir / "dead-letter-hook.jsonl"

    def hook_calls(self) -> list[dict[str, Any]]:
        if not self.hook_log_path.exists():
            return []
        return [json.loads(line) for line in self.hook_log_path.read_text().splitlines()]

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env.update(
            FLEET_DATABASE_URL=self.database_url,
            FLEET_BROKER_URL=self.broker_url,
            FLEET_LEASE_SECONDS=str(self.lease_seconds),
            FLEET_SWEEP_INTERVAL="0.2",
            FLEET_SWEEP_GRACE="1.0",
            FLEET_TEST_LOG=str(self.log_path),
            FLEET_TEST_HOOK_LOG=str(self.hook_log_path),
            FLEET_TEST_PROVIDER=str(self.provider_path),
            # A planted bug's copy of fleet first (FLEET_MUTANT, tests/chaos/mutants.py).
            PYTHONPATH=os.pathsep.join([*mutants.planted(), str(ROOT)]),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        env.update(extra)
        return env

    def settings(self) -> Settings:
        return Settings.from_env(self.env())

    def flush_broker(self) -> None:
        """Lose every message: FLUSHDB of the broker's Redis database (FLUSHALL would
        also empty other users' databases), or empty the filesystem queue."""
        if self.kind == "postgres":
            import redis

            redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB).flushdb()
        else:
            for f in (self.workdir / "broker" / "queue").iterdir():
                f.unlink(missing_ok=True)

    def queued_messages(self) -> int:
        if self.kind == "postgres":
            import redis

            r = redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB)
            # Every fleet queue: the default one and one per workflow version.
            return sum(int(r.llen(k)) for k in r.scan_iter("fleet*") if r.type(k) == b"list")
        return len(list((self.workdir / "broker" / "queue").iterdir()))


def backend_while(kind: str, workdir: Path) -> Iterator[Backend]:
    """A backend of ``kind`` for a fixture to yield, cleaned up after it."""
    b = make_backend(kind, workdir)
    yield b
    for undo in b.cleanup:
        undo()


def make_backend(kind: str, workdir: Path) -> Backend:
    if kind == "sqlite":
        return Backend(
            kind, workdir, f"sqlite:///{workdir}/fleet.db", f"filesystem:///{workdir}/broker"
        )
    require_services()
    import psycopg
    import redis

    name = f"fleet_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB).flushdb()
    backend = Backend(
        kind,
        workdir,
        f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}",
        f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}",
    )

    def drop() -> None:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    backend.cleanup.append(drop)
    return backend


def delete_store(backend: Backend, *clients: Fleet) -> None:
    """Delete the backend's store (the SQLite file with its -wal and -shm, or the
    Postgres database), the ``clients`` on it disposed of first: a history must do
    without it. Teardown's DROP DATABASE IF EXISTS then finds nothing."""
    for client in clients:
        client.runtime.db.dispose()
    if backend.kind == "sqlite":
        path = Path(backend.database_url.removeprefix("sqlite:///"))
        for file in path.parent.glob(path.name + "*"):
            file.unlink()
    for undo in backend.cleanup:
        undo()


def client_for(backend: Backend) -> Fleet:
    """A Fleet on the backend with the test workflows registered (as workers have them)."""
    from tests import flows

    client = flows.fleet.with_settings(backend.settings())
    client.upgrade_schema()
    return client


class Cluster:
    """Workers and sweepers for one test; everything is killed at teardown."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.procs: list[FleetProcess] = []

    def _start(self, name: str, argv: list[str], ready: str, env: dict[str, str]) -> FleetProcess:
        proc = FleetProcess(name, argv, env, self.backend.workdir)
        self.procs.append(proc)
        if not proc.wait_for_output(ready, 30):
            pytest.fail(f"{name} did not start:\n{proc.output()}")
        return proc

    def worker(
        self, name: str, concurrency: int = 4, pool: str = "threads", app: str = APP
    ) -> FleetProcess:
        return self._start(
            name,
            worker_argv(app, concurrency, pool),
            WORKER_READY,
            self.backend.env(FLEET_WORKER_NAME=name),
        )

    def sweeper(self, name: str = "sweeper") -> FleetProcess:
        return self._start(name, sweeper_argv(APP), SWEEPER_READY, self.backend.env())

    def by_pid(self, pid: int) -> FleetProcess:
        return next(p for p in self.procs if p.pid == pid)

    def stop(self) -> None:
        for proc in self.procs:
            proc.signal(signal.SIGKILL)
            proc.stop()


def everything_in_the_store(client: Fleet) -> str:
    """Every row of every table, as text: to check a value appears nowhere."""
    from sqlalchemy import select

    from fleet.store.schema import metadata

    with client.runtime.db.begin() as conn:
        return "\n".join(
            repr(tuple(row))
            for table in metadata.sorted_tables
            for row in conn.execute(select(table)).all()
        )


def executions(backend: Backend, run_id: str | None = None) -> list[dict[str, Any]]:
    """Every step execution the test workflows logged, outside the store."""
    if not backend.log_path.exists():
        return []
    events = [json.loads(line) for line in backend.log_path.read_text().splitlines() if line]
    return [e for e in events if run_id is None or e["run"] == run_id]


def starts(backend: Backend, run_id: str) -> Counter[str]:
    return Counter(e["step"] for e in executions(backend, run_id) if e["event"] == "start")


def find_event(
    backend: Backend, run_id: str, step: str, event: str, **match: Any
) -> dict[str, Any] | None:
    for e in executions(backend, run_id):
        if e["step"] == step and e["event"] == event and all(e[k] == v for k, v in match.items()):
            return e
    return None


def same(a: Any, b: Any) -> bool:
    """Whether two JSON values are the same value: ``==`` but with types kept apart
    (``1``, ``1.0`` and ``True`` are three values here) and key order ignored."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return False
        return all(same(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return False
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


class Wire:
    """Round trips to Postgres made by the thread that started it, read from libpq's
    protocol trace (``PQtrace``) of each connection it checks out of any pool, from
    checkout to checkin: one round trip is a run of messages the client sends (``F``
    lines) followed by the server's answer (``B`` lines). BEGIN and COMMIT count as the
    statements do; other threads' connections (a heartbeat's) are not traced."""

    def __init__(self) -> None:
        self.trips = 0
        self.per_checkout: list[int] = []  # each checkout's round trips, in order
        self._thread = 0
        self._traced: dict[int, Any] = {}  # id(pgconn) -> the file its trace goes to

    def _checkout(self, dbapi_conn: Any, *_: Any) -> None:
        from psycopg import pq

        pgconn = getattr(dbapi_conn, "pgconn", None)
        if pgconn is None or threading.get_ident() != self._thread:
            return
        out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed at checkin
        pgconn.trace(os.dup(out.fileno()))
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        self._traced[id(pgconn)] = out

    def _checkin(self, dbapi_conn: Any, *_: Any) -> None:
        pgconn = getattr(dbapi_conn, "pgconn", None)
        out = self._traced.pop(id(pgconn), None)
        if out is None:
            return
        pgconn.untrace()  # flushes the trace
        out.seek(0)
        side, trips = "B", 0
        for line in out:
            if line[:1] == "B" and side == "F":
                trips += 1
            if line[:1] in ("F", "B"):
                side = line[:1]
        out.close()
        self.trips += trips
        self.per_checkout.append(trips)

    def start(self) -> None:
        from sqlalchemy import event
        from sqlalchemy.pool import Pool

        self._thread = threading.get_ident()
        event.listen(Pool, "checkout", self._checkout)
        event.listen(Pool, "checkin", self._checkin)

    def stop(self) -> int:
        """Stop tracing; the round trips counted since ``start`` (on connections
        checked in since)."""
        from sqlalchemy import event
        from sqlalchemy.pool import Pool

        event.remove(Pool, "checkout", self._checkout)
        event.remove(Pool, "checkin", self._checkin)
        return self.trips
