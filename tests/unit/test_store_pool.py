"""A worker running its tasks as threads or greenlets keeps one Postgres connection per
task it runs at once, up to FLEET_DB_POOL_MAX, plus a few for its own threads, and
opens none beyond; a prefork worker's processes and a client keep the default pool.
No services: an engine opens no connection until used."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery.concurrency import get_implementation

from fleet import Fleet, Settings
from fleet.errors import BadInput
from fleet.store.engine import POOL_OVERFLOW, POOL_SIZE, SIZED_HEADROOM, Database
from fleet.worker.tasks import _size_store_pool

PG = "postgresql+psycopg://postgres@127.0.0.1:1/never_connected"


def _pool(db: Database) -> tuple[int, int]:
    """Connections kept, and the most opened beyond them at a peak."""
    pool = db.engine.pool
    return int(pool.size()), int(pool._max_overflow)  # type: ignore[attr-defined]


def _worker(fleet: Fleet, pool: str, concurrency: int) -> None:
    """What Celery's ``celeryd_after_setup`` hands the handler of a worker so started."""
    instance = SimpleNamespace(app=fleet.celery, pool_cls=get_implementation(pool))
    instance.concurrency = concurrency
    _size_store_pool(sender="w@host", instance=instance)


def test_a_process_that_does_not_say_keeps_the_default_pool() -> None:
    assert _pool(Database(PG)) == (POOL_SIZE, POOL_OVERFLOW)


def test_sizing_replaces_the_engine_with_one_that_opens_none_beyond_its_pool() -> None:
    db = Database(PG)
    before = db.engine
    db.size_pool(40)
    assert db.engine is not before and _pool(db) == (40 + SIZED_HEADROOM, 0)
    same = db.engine
    db.size_pool(40)
    assert db.engine is same, "the same size again keeps the engine"
    with pytest.raises(BadInput, match="for 0 tasks"):
        db.size_pool(0)
    assert db.engine is same, "bad input changes nothing"


@pytest.mark.parametrize(
    ("pool", "concurrency", "kept"),
    [
        ("gevent", 200, 10 + SIZED_HEADROOM),
        # A threads pool's async attempts go on off its slots, on strands: one each.
        ("threads", 8, 8 + Settings.async_strands + SIZED_HEADROOM),
        ("prefork", 8, POOL_SIZE),
        ("solo", 1, POOL_SIZE),
    ],
)
def test_a_worker_sizes_its_pool_by_its_concurrency_up_to_the_cap(
    pool: str, concurrency: int, kept: int
) -> None:
    fleet = Fleet("poolsize", settings=Settings(database_url=PG))
    _worker(fleet, pool, concurrency)
    assert _pool(fleet.runtime.db)[0] == kept


def test_the_cap_is_a_setting() -> None:
    settings = Settings.from_env({"FLEET_DATABASE_URL": PG, "FLEET_DB_POOL_MAX": "100"})
    fleet = Fleet("poolcap", settings=settings)
    _worker(fleet, "gevent", 200)
    assert _pool(fleet.runtime.db) == (100 + SIZED_HEADROOM, 0)
    with pytest.raises(BadInput, match="FLEET_DB_POOL_MAX='lots'"):
        Settings.from_env({"FLEET_DB_POOL_MAX": "lots"})


def test_a_threads_pool_keeps_one_more_for_each_strand_only_while_strands_are_on() -> None:
    """A strand commits an async attempt while every slot may hold a connection: without
    its own it waits in the pool's queue behind the slots (bench.async_steps: 16 strands
    sharing 13 connections ran 0.59 of the limit)."""
    env = {"FLEET_DATABASE_URL": PG, "FLEET_ASYNC_STRANDS": "3"}
    fleet = Fleet("poolstrands", settings=Settings.from_env(env))
    _worker(fleet, "threads", 8)
    assert _pool(fleet.runtime.db) == (8 + 3 + SIZED_HEADROOM, 0)
    off = Fleet("poolnostrands", settings=Settings.from_env({**env, "FLEET_ASYNC_AWAITING": "0"}))
    _worker(off, "threads", 8)
    assert _pool(off.runtime.db) == (8 + SIZED_HEADROOM, 0), "no strands: none for them"
    gevent = Fleet("poolgevent", settings=Settings.from_env(env))
    _worker(gevent, "gevent", 8)
    assert _pool(gevent.runtime.db) == (8 + SIZED_HEADROOM, 0), "strands are a threads pool's"
