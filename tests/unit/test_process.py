"""A worker process's state is one object: the Fleets registered in it are held weakly
(one built and dropped is not kept for the life of the process), and each Celery app
finds its own Fleet's runtime. No services."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from fleet import Fleet, Settings
from fleet.worker import process


def _fleet(tmp_path: Path, name: str) -> Fleet:
    return Fleet(name, settings=Settings(database_url=f"sqlite:///{tmp_path}/{name}.db"))


def test_a_dropped_fleet_is_not_kept_by_the_process(tmp_path: Path) -> None:
    dropped = _fleet(tmp_path, "dropped")
    kept = _fleet(tmp_path, "kept")  # also replaces the first as Celery's current app
    gone = weakref.ref(dropped.runtime)
    assert gone() in process.current().runtimes()
    del dropped
    gc.collect()
    assert gone() is None, "the process kept a Fleet nobody holds"
    assert kept.runtime in process.current().runtimes()


def test_each_celery_app_finds_its_own_runtime(tmp_path: Path) -> None:
    a, b = _fleet(tmp_path, "a"), _fleet(tmp_path, "b")
    proc = process.current()
    assert proc.runtime_of(a.celery) is a.runtime
    assert proc.runtime_of(b.celery) is b.runtime
    assert proc.runtime_of(object()) is None
    assert process.current() is proc, "one Process per process"


def test_each_forked_process_holds_leases_under_its_own_name(tmp_path: Path) -> None:
    """Celery's prefork children each hold their own leases: the name a runtime takes
    them under is its process's, even when the runtime was made before the fork."""
    import os

    rt = _fleet(tmp_path, "named").runtime
    parent = rt.worker_name
    assert parent.endswith(f":{os.getpid()}") and rt.worker_name == parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its name, then out at once (no test teardown here)
        os.write(write, rt.worker_name.encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child == f"{parent.rpartition(':')[0]}:{pid}"
