"""What a fleet application's own tests import.

``InlineBroker`` stands in for the broker: the ``Fleet``'s messages are kept in a list
and delivered in the test's own process by ``step`` and ``drain``, through the same
engine entry points a worker's tasks call. With an SQLite store a workflow runs end to
end with no broker, no worker and no services::

    fleet = app.fleet.with_settings(Settings(database_url=f"sqlite:///{tmp}/t.db"))
    fleet.upgrade_schema()
    broker = InlineBroker(fleet)
    run = fleet.enqueue("research", "topic")
    broker.drain()
    assert run.wait(timeout=0) == ...

A message is delivered at once, whatever its countdown; the step it names runs only
when the store says it is due, as on a worker. So give steps no retry delay in tests
(``RetryPolicy(initial_delay=0)``): a short one is re-sent until due (``drain`` spins),
a long one waits for the sweeper, which an InlineBroker does not run.

``FleetProcess`` and the ``*_argv`` helpers start real ``fleet worker`` and ``fleet
sweeper`` processes (each in its own process group, so a signal reaches all of it)
for tests that kill or freeze one; ``fleet demo`` uses them too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fleet.app import Fleet
from fleet.worker.attempt import execute
from fleet.worker.dispatch import ADVANCE, EXECUTE, Message
from fleet.worker.replay import advance


class InlineBroker:
    """The fleet's broker, in this process: ``sent`` holds the messages not yet
    delivered as ``(task, ids)``, oldest first (``("fleet.advance", [run_id])``,
    ``("fleet.execute", [run_id, step_id])``)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.sent: list[tuple[str, list[str]]] = []
        fleet.runtime.dispatcher.use(self)

    def send(self, message: Message) -> None:
        """The ``Sender`` side: keep the message until it is delivered."""
        self.sent.append((message.task, list(message.args)))

    def waiting(self, queues: Sequence[str]) -> int:
        """The ``Sender`` side: every message not yet delivered waits (one queue here)."""
        return len(self.sent)

    def step(self) -> None:
        """Deliver the oldest message, as a worker's task would."""
        task, args = self.sent.pop(0)
        if task == ADVANCE:
            advance(self.fleet.runtime, args[0])
        elif task == EXECUTE:
            execute(self.fleet.runtime, args[0], args[1])
        else:
            raise ValueError(f"not a fleet message: {task!r}")

    def drain(self, until: Callable[[], bool] = lambda: False, limit: int = 1000) -> None:
        """Deliver messages until none is left or ``until()`` holds; AssertionError if
        ``limit`` deliveries did not get there (a run that never settles)."""
        for _ in range(limit):
            if not self.sent or until():
                return
            self.step()
        raise AssertionError(f"messages kept coming: {limit} delivered, {len(self.sent)} left")


# --- worker and sweeper processes -------------------------------------------------------

WORKER_READY = "ready."
SWEEPER_READY = "sweeper started"


def worker_argv(app: str, concurrency: int, pool: str = "threads") -> list[str]:
    return ["worker", "-A", app, "--concurrency", str(concurrency), "--pool", pool]


def sweeper_argv(app: str) -> list[str]:
    return ["sweeper", "-A", app]


class FleetProcess:
    """``python -m fleet ARGV…`` (or another ``module``) with its output in ``logdir/NAME.log``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        logdir: Path,
        cwd: Path | None = None,
        module: str = "fleet",
    ) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            env=env,
            cwd=cwd or logdir,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_output(self, marker: str, timeout: float) -> bool:
        """Poll the log for ``marker``; False if the process died or time ran out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.output():
                return True
            if not self.alive:
                return False
            time.sleep(0.05)
        return False

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive:
            self.signal(signal.SIGCONT)  # a frozen process cannot die of SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(timeout=timeout)
        self._out.close()
