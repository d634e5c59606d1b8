"""Driving the three systems the benchmarks compare: a fleet client and fleet workers on
``bench.noop_flows``, raw Celery workers on ``bench.raw_celery``, DBOS in a subprocess,
and the clocks that say when each one finished."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from bench import raw_celery
from bench.common import ROOT, Services, processes, wait_until
from fleet import Fleet, Settings
from fleet.testing import WORKER_READY, worker_argv

FLEET_APP = "bench.noop_flows"
# gevent is left out: `python -m fleet worker` does not monkey-patch (see benchmark 3).
POOLS = ("threads", "prefork", "solo")
# What a Celery worker logs at INFO for each message it takes, and each task that ran.
RECEIVED, SUCCEEDED = "] received", "] succeeded in "


def database_name(svc: Services) -> str:
    return svc.database_url.rsplit("/", 1)[1]


def fleet_client(svc: Services, app: Fleet | None = None, **env: str) -> Fleet:
    """A fleet app (``bench.noop_flows``'s unless given) bound to ``svc`` and ``env``,
    schema migrated, no connection left open (so the database's statistics can settle
    before workers start)."""
    if app is None:
        from bench import noop_flows

        app = noop_flows.fleet
    client = app.with_settings(Settings.from_env(svc.env(**env)))
    client.upgrade_schema()
    client.runtime.db.dispose()
    return client


@contextlib.contextmanager
def fleet_workers(
    svc: Services, count: int, concurrency: int, pool: str, app: str = FLEET_APP, **env: str
) -> Iterator[list[Any]]:
    """``count`` fleet worker processes loading ``app``, with ``env``, ready; killed on exit."""
    argvs = [(f"fleet{i}", worker_argv(app, concurrency, pool)) for i in range(count)]
    with processes(svc, argvs, WORKER_READY, 60.0, "fleet", **env) as procs:
        yield procs


@contextlib.contextmanager
def celery_workers(svc: Services, count: int, concurrency: int, pool: str) -> Iterator[list[Any]]:
    """``count`` raw Celery worker processes, ready; killed on exit."""
    names = [f"raw{i}" for i in range(count)]
    argvs = [(name, raw_celery.worker_argv(name, concurrency, pool)) for name in names]
    with processes(svc, argvs, raw_celery.READY, module="celery") as procs:
        yield procs


class RunClock:
    """Polls the store (one autocommit connection: one transaction per poll, counted)
    until runs have finished, and reads their duration on the database's clock."""

    def __init__(self, svc: Services) -> None:
        import psycopg

        self._conn = psycopg.connect(svc.libpq_url, autocommit=True)
        self.polls = 0

    def close(self) -> None:
        self._conn.close()

    def _finished(self, run_ids: Sequence[str]) -> bool:
        self.polls += 1
        row = self._conn.execute(
            "SELECT count(*) FROM fleet_runs WHERE id = ANY(%s) AND finished_at IS NOT NULL",
            (list(run_ids),),
        ).fetchone()
        return row is not None and row[0] == len(run_ids)

    def wait(self, run_ids: Sequence[str], timeout: float, interval: float = 0.05) -> float:
        """Seconds from the first run's creation (its enqueue) to the last one's finish,
        on the store's clock; raises if any run did not succeed."""
        wait_until(lambda: self._finished(run_ids), timeout, "fleet runs", interval)
        self.polls += 1
        rows = self._conn.execute(
            "SELECT status, created_at, finished_at FROM fleet_runs WHERE id = ANY(%s)",
            (list(run_ids),),
        ).fetchall()
        failed = [r[0] for r in rows if r[0] != "succeeded"]
        if failed:
            raise RuntimeError(f"{len(failed)} fleet run(s) did not succeed: {failed[:3]}")
        return max(r[2] for r in rows) - min(r[1] for r in rows)


def celery_app(svc: Services) -> Any:
    """The raw Celery app, publishing to ``svc``'s broker."""
    raw_celery.app.conf.broker_url = svc.broker_url
    return raw_celery.app


def dbos_seconds(svc: Services, steps: int, timeout: float = 300.0) -> float:
    """One DBOS workflow of ``steps`` no-op steps, in a fresh process on ``svc``'s database."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.dbos_flows", svc.database_url, str(steps)],
        env=svc.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"DBOS run failed:\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def quiet_redis(seconds: float = 1.0) -> float:
    """Redis commands per second from everyone while this benchmark sends nothing: the
    background that pollutes server-wide command counts."""
    from bench.common import redis_calls

    before = redis_calls()
    time.sleep(seconds)
    after = redis_calls()
    # INFO itself is ours.
    return (sum(after.values()) - sum(before.values()) - 1) / seconds
