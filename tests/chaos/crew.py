"""The worker processes under fire: fixed slots, each holding one worker process at a
time; a killed worker is replaced in its slot by a new process (a new pid)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from fleet.testing import WORKER_READY, FleetProcess, worker_argv

APP = "tests.chaos.flows"


class Crew:
    def __init__(
        self,
        spawn: Callable[[str, list[str]], FleetProcess],
        size: int,
        concurrency: int,
        app: str = APP,
    ) -> None:
        self._spawn = spawn
        self._app = app
        self._concurrency = concurrency
        self._lock = threading.Lock()
        self._generation = [0] * size
        self.slots: list[FleetProcess] = [self._start(i) for i in range(size)]
        self.retired: list[FleetProcess] = []
        self.frozen: set[int] = set()

    def _start(self, slot: int) -> FleetProcess:
        self._generation[slot] += 1
        name = f"worker{slot}.{self._generation[slot]}"
        return self._spawn(name, worker_argv(self._app, self._concurrency, "threads"))

    def wait_ready(self, timeout: float = 60.0) -> None:
        for proc in self.slots:
            if not proc.wait_for_output(WORKER_READY, timeout):
                raise RuntimeError(f"{proc.name} did not start:\n{proc.output()[-3000:]}")

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self.slots]

    def alive(self, pid: int | None) -> bool:
        """Whether ``pid`` is one of the crew's workers and still running."""
        with self._lock:
            return any(p.pid == pid and p.alive for p in self.slots)

    def kill(self, slot: int) -> int:
        """SIGKILL the slot's worker (its whole process group); returns its pid."""
        with self._lock:
            proc = self.slots[slot]
            proc.signal(signal.SIGKILL)
            proc.stop()
            self.retired.append(proc)
            return proc.pid

    def replace(self, slot: int) -> int:
        with self._lock:
            self.slots[slot] = self._start(slot)
            return self.slots[slot].pid

    def freeze(self, slot: int) -> int:
        with self._lock:
            self.frozen.add(slot)
            self.slots[slot].signal(signal.SIGSTOP)
            return self.slots[slot].pid

    def thaw(self, slot: int) -> None:
        with self._lock:
            self.slots[slot].signal(signal.SIGCONT)
            self.frozen.discard(slot)

    def stop(self) -> None:
        with self._lock:
            for proc in self.slots:
                proc.signal(signal.SIGCONT)
                proc.signal(signal.SIGKILL)
                proc.stop()
