"""Fleet processes (workers, sweepers) started as subprocesses, each in its own process
group so that a signal reaches all of it: used by the demo and by the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


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


WORKER_READY = "ready."
SWEEPER_READY = "sweeper started"


def worker_argv(app: str, concurrency: int, pool: str = "threads") -> list[str]:
    return ["worker", "-A", app, "--concurrency", str(concurrency), "--pool", pool]


def sweeper_argv(app: str) -> list[str]:
    return ["sweeper", "-A", app]
