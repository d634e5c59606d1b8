"""What a worker process holds across the Fleets built in it, in one object.

A process has one heartbeat thread (``Beater``), one event loop for async steps
(``EventLoop``, in a thread of its own), the strands async attempts run on off their
slots (``Strands``, on a threads pool only), one ``stopping`` flag (set when a warm
shutdown begins: tasks stop running further steps inline) and the Fleets registered in
it, which its one shutdown handler serves (a worker module may import another that
builds its own Fleet). ``current()`` is the process's one ``Process``, created on first
use. A forked child (Celery's prefork pool) inherits it; its beater and its loop start
threads of their own there on first use, since threads do not survive fork.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from fleet.worker.aio import EventLoop
from fleet.worker.heartbeat import Beater, release_leases
from fleet.worker.runtime import Runtime
from fleet.worker.strands import Strands


class Process:
    """This process's worker state: the beater, the shutdown flag, the registered Fleets."""

    def __init__(self) -> None:
        self.beater = Beater()
        self.loop = EventLoop()  # where async steps run; its thread made on first use
        # Where async steps' attempts go on off their slots (a threads pool configures it).
        self.strands = Strands()
        self.stopping = threading.Event()
        # Each registered runtime with its Celery app, both held weakly: a Fleet built
        # and dropped (a test's, the demo's scratch one) is not kept alive by the process.
        self._apps: weakref.WeakKeyDictionary[Runtime, weakref.ref[Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def register(self, rt: Runtime, celery: Any) -> None:
        """Serve ``rt`` (whose tasks are bound to ``celery``) at shutdown and worker setup."""
        with self._lock:
            self._apps[rt] = weakref.ref(celery)

    def runtimes(self) -> list[Runtime]:
        """The registered runtimes still alive."""
        with self._lock:
            return list(self._apps.keys())

    def runtime_of(self, celery: Any) -> Runtime | None:
        """The runtime whose tasks are bound to ``celery``, if one is registered."""
        with self._lock:
            for rt, app in self._apps.items():
                if app() is celery:
                    return rt
        return None

    def release_leases(self) -> int:
        """Give up every lease this process's attempts hold (shutdown deadline)."""
        held = self.beater.held()
        return sum(release_leases(rt, held) for rt in self.runtimes())


_process: Process | None = None
_created = threading.Lock()


def current() -> Process:
    """This process's ``Process``, created on first use."""
    global _process
    if _process is None:
        with _created:
            if _process is None:
                _process = Process()
    return _process
