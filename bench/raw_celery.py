"""The raw Celery baseline: a plain Celery app with one no-op task on the same Redis
broker as fleet, ``acks_late`` and no result backend.

Its settings are fleet's where they change what a task costs (JSON, late ack, prefetch
of one, results ignored) and Celery's defaults otherwise (no task events). Workers:
``python -m celery -A bench.raw_celery worker``; the broker is ``BENCH_BROKER_URL``
(``FLEET_BROKER_URL`` when unset, as the benchmark's environment sets it)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from celery import Celery

QUEUE = "raw"
READY = "ready."


def _broker() -> str:
    return (
        os.environ.get("BENCH_BROKER_URL")
        or os.environ.get("FLEET_BROKER_URL")
        or "redis://127.0.0.1:6379/12"
    )


app = Celery("raw", broker=_broker(), set_as_current=False)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    result_backend=None,
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="raw.noop", ignore_result=True)
def noop(i: int, mark: str | None = None) -> int:
    """Does nothing. With ``mark`` (the last task of a chain) it writes the time it ran
    to that Redis key, which the benchmark polls."""
    if mark:
        import redis

        redis.Redis.from_url(_broker()).set(mark, repr(time.time()))
    return i


# The floor of a durable step (``bench.many_runs``): one row per step, committed alone.
CHECKPOINTS_TABLE = (
    "CREATE TABLE raw_checkpoints (run integer, step integer, output text NOT NULL,"
    " PRIMARY KEY (run, step))"
)
_store = threading.local()


def _connection() -> Any:
    """This thread's store connection (autocommit: each statement its own transaction),
    on the benchmark's database (``FLEET_DATABASE_URL``)."""
    conn = getattr(_store, "conn", None)
    if conn is None:
        import psycopg

        url = os.environ["FLEET_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
        conn = _store.conn = psycopg.connect(url, autocommit=True)
    return conn


@app.task(name="raw.checkpoints", ignore_result=True)
def checkpoints(run: int, steps: int) -> int:
    """The least a durable run of ``steps`` no-op steps can cost on Celery and Postgres:
    one message for the run, and one commit per step (its output's row, one statement
    in its own transaction: one round trip). No lease, no fence, no history: a floor,
    not an engine."""
    conn = _connection()
    for step in range(steps):
        conn.execute(
            "INSERT INTO raw_checkpoints (run, step, output) VALUES (%s, %s, %s)",
            (run, step, "null"),
        )
    return run


def worker_argv(name: str, concurrency: int, pool: str) -> list[str]:
    """``celery`` arguments for one worker, as fleet's CLI starts its own (INFO logging,
    no mingle or gossip)."""
    return [
        "-A",
        "bench.raw_celery",
        "worker",
        "--loglevel=INFO",
        f"--concurrency={concurrency}",
        f"--pool={pool}",
        f"--queues={QUEUE}",
        f"--hostname={name}@%h",
        "--without-mingle",
        "--without-gossip",
    ]
