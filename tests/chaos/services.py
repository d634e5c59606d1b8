"""A private Postgres cluster and a private Redis for the chaos harness, so that
restarting or flushing them disturbs nothing else on the machine.

Postgres comes from Debian's postgresql-common (``pg_createcluster``/``pg_ctlcluster``,
run as root); Redis is a ``redis-server`` child process keeping nothing on disk.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path


class ServiceError(RuntimeError):
    """A service the chaos harness needs could not be started or restarted."""


def _wait_port(port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise ServiceError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")


def _run(argv: list[str], timeout: float = 60.0) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ServiceError(f"{' '.join(argv)} failed: {(done.stderr or done.stdout).strip()}")


class PrivatePostgres:
    """``pg_createcluster <version> fleetchaos -p PORT``: created fresh, dropped at the end."""

    def __init__(self, port: int = 5439, name: str = "fleetchaos") -> None:
        if shutil.which("pg_createcluster") is None:
            raise ServiceError(
                "pg_createcluster not found: the chaos harness needs Debian's "
                "postgresql-common (and root) to run a Postgres cluster it may restart"
            )
        versions = sorted((p.name for p in Path("/usr/lib/postgresql").iterdir()), key=int)
        self.version, self.name, self.port = versions[-1], name, port
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/chaos"

    def _ctl(self, action: str, *extra: str) -> None:
        _run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.name, action, *extra]
        )

    def start(self) -> None:
        self.drop()  # a cluster left behind by an interrupted run
        _run(
            [
                "pg_createcluster",
                self.version,
                self.name,
                "-p",
                str(self.port),
                "--",
                "--auth=trust",
            ]
        )
        self._ctl("start")
        _wait_port(self.port, 30, "the chaos Postgres")
        _run(
            [
                "psql",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-qc",
                "CREATE DATABASE chaos",
            ]
        )

    def restart(self) -> None:
        """Fast shutdown (every connection is cut, open transactions roll back), start."""
        self._ctl("restart", "-m", "fast")
        _wait_port(self.port, 30, "the chaos Postgres")

    def drop(self) -> None:
        subprocess.run(
            ["pg_dropcluster", "--stop", self.version, self.name], capture_output=True, timeout=60
        )


class PrivateRedis:
    """``redis-server`` on its own port, without persistence: a restart loses everything."""

    FLUSHED = "every queued and unacked message lost"

    def __init__(self, port: int = 6399, logdir: Path | None = None) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._log = (logdir or Path("/tmp")) / f"redis-{port}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self._log),
        ]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, 15, "the chaos Redis")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def restart(self, down: float = 0.0) -> None:
        """Killed (no shutdown, no save), down for ``down`` seconds, started empty."""
        self.stop()
        time.sleep(down)
        self.start()

    def flushall(self) -> None:
        import redis

        redis.Redis("127.0.0.1", self.port).flushall()


class EmbeddedStore:
    """The embedded default's store for the chaos run: a SQLite file in the workdir.
    Nothing to start; it cannot be restarted (no server), so the Postgres faults do not
    apply to it."""

    def __init__(self, workdir: Path) -> None:
        self.path = workdir / "fleet.db"
        self.url = f"sqlite:///{self.path}"

    def start(self) -> None:
        pass

    def restart(self) -> None:
        raise ServiceError("the embedded store (SQLite) has no server to restart")

    def drop(self) -> None:
        pass


class EmbeddedBroker:
    """The embedded default's broker: Celery's filesystem transport in ``workdir/broker``.
    ``flushall`` loses every queued message (the files of its queue folder), as a Redis
    FLUSHALL does; there is no server to restart."""

    FLUSHED = "every queued message lost (the queue folder emptied)"

    def __init__(self, workdir: Path) -> None:
        self.folder = workdir / "broker"
        self.url = f"filesystem:///{self.folder}"

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def restart(self, down: float = 0.0) -> None:
        raise ServiceError("the embedded broker (a folder) has no server to restart")

    def flushall(self) -> None:
        queue = self.folder / "queue"
        if queue.is_dir():
            for f in queue.iterdir():
                with contextlib.suppress(OSError):
                    f.unlink()
