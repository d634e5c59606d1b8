"""A worker process freezes what its start-up built and collects cycles at
``FLEET_GC_THRESHOLD`` (fleet/worker/collector.py), set once Celery has set the worker up
and before its pool starts; ``python`` leaves the interpreter's own thresholds."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery.concurrency import get_implementation

from fleet import BadInput, Fleet, Settings
from fleet.worker import collector
from fleet.worker.tasks import _tune_collector


@pytest.fixture(autouse=True)
def _interpreter_gc() -> Iterator[None]:
    """Whatever a test sets, the interpreter's own collector comes back after it."""
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_the_threshold_is_three_whole_numbers_or_python() -> None:
    assert Settings.from_env({}).gc_threshold == (5000, 20, 100)
    assert Settings.from_env({"FLEET_GC_THRESHOLD": " 700, 10,10 "}).gc_threshold == (700, 10, 10)
    assert Settings.from_env({"FLEET_GC_THRESHOLD": "python"}).gc_threshold is None
    for bad in ("5000,20", "0,10,10", "a,b,c", "1e3,10,10", "5000,20,100,1", "-1,2,3"):
        with pytest.raises(BadInput, match=r"FLEET_GC_THRESHOLD=.* must be three whole numbers"):
            Settings.from_env({"FLEET_GC_THRESHOLD": bad})


def test_tune_freezes_what_start_up_built_and_sets_the_thresholds() -> None:
    built = [[i] for i in range(1000)]  # start-up's objects, held
    collector.tune((4321, 12, 34))
    assert gc.get_threshold() == (4321, 12, 34)
    assert gc.get_freeze_count() >= len(built)


def test_python_leaves_the_interpreter_s_collector_alone() -> None:
    gc.set_threshold(700, 10, 10)
    collector.tune(None)
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0


def test_a_worker_tunes_it_once_set_up(tmp_path: Path) -> None:
    env = {"FLEET_GC_THRESHOLD": "2345,6,7", "FLEET_DATABASE_URL": f"sqlite:///{tmp_path}/f.db"}
    settings = Settings.from_env(env)
    fleet = Fleet("gcworker", settings=settings)
    instance = SimpleNamespace(app=fleet.celery, pool_cls=get_implementation("threads"))
    _tune_collector(sender="w@host", instance=instance)
    assert gc.get_threshold() == (2345, 6, 7) and gc.get_freeze_count() > 0
