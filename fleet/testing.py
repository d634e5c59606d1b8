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

``replay`` runs a recorded run's workflow in the caller's process over its history, no
step body executed and nothing written (fleet/worker/replayer.py): where the run ended,
or what it would do next, or ``NonDeterminism`` naming the first step the code no
longer takes. ``export`` reads a run's history as one JSON document
(fleet/store/exports.py), which ``replay(history=)`` replays with no database.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace as replaced
from pathlib import Path
from typing import Any

from fleet.app import Fleet
from fleet.config import Settings
from fleet.errors import BadInput, UnknownRun
from fleet.records import Replay
from fleet.registry import Registry, StepDef, WorkflowDef
from fleet.store import exports
from fleet.store.queries import Queries
from fleet.store.readonly import read_only
from fleet.worker.attempt import execute
from fleet.worker.dispatch import ADVANCE, EXECUTE, Message
from fleet.worker.replay import advance
from fleet.worker.replayer import local_runtime, replay_recorded


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


# --- a recorded run replayed locally --------------------------------------------------


def replay(
    run_id: str | None = None,
    *,
    database_url: str | None = None,
    fleet: Fleet | None = None,
    workflow: WorkflowDef | str | None = None,
    history: str | os.PathLike[str] | Mapping[str, Any] | None = None,
) -> Replay:
    """Replay the recorded run ``run_id`` in this process: its workflow function runs
    over its history, each step handing back its recorded output (no step body, effect
    or model call runs), each wait its signal, ``now``, ``random``, transcripts and
    child runs as recorded, and stops at the first step not finished. Returns a
    ``fleet.records.Replay``: ``finished`` with the result, ``failed`` with the error
    (as the run records them), or ``suspended`` with the steps it stands before
    (``next``) and the signal it waits for (``wait``). Raises ``NonDeterminism`` naming
    the first step where the workflow no longer does what the history records.

    Read-only: the store is opened so that the database refuses any write. The store is
    ``database_url``, else ``fleet``'s. Or, with no database at all, ``history``: a file
    ``fleet export`` wrote (its path) or its document loaded (``export``'s dict); the
    run is the history's (``run_id``, if given, must be it). The workflow is
    ``workflow`` (a definition, or the name of one ``fleet`` registered: another version
    of the code), else the one ``fleet`` registered under the run's name, which must be
    the run's version and pins. Without ``fleet``, ``workflow`` must be a definition and
    ``database_url`` or ``history`` given: the steps and child workflows it names are
    taken as it hands them over (by definition, not by name)."""
    if history is not None and database_url is not None:
        raise BadInput("replay reads a store (database_url=) or a history (history=), not both")
    registry: Registry
    if fleet is None:
        if not isinstance(workflow, WorkflowDef) or (database_url is None and history is None):
            raise BadInput(
                "replay needs the Fleet the run's workflow is registered on (fleet=), or "
                "the workflow's definition (workflow=) and the store (database_url=) or "
                "an exported history (history=)"
            )
        settings, registry = Settings.from_env(database_url=database_url), _Given()
    else:
        settings, registry = fleet.settings, fleet.registry
        if database_url is not None:
            settings = replaced(settings, database_url=database_url)
    exported = None if history is None else exports.load(history)
    if exported is not None:
        if run_id is not None and run_id != exported.run_id:
            raise BadInput(f"the history is of run {exported.run_id!r}, not {run_id!r}")
        run_id = exported.run_id
    if run_id is None:
        raise BadInput("replay needs the run's id, or its exported history (history=)")
    if isinstance(workflow, str):
        workflow = registry.workflow(workflow)
    rt = local_runtime(settings, registry, exported)
    try:
        return replay_recorded(rt, run_id, workflow)
    finally:
        rt.db.dispose()


def export(
    run_id: str, *, database_url: str | None = None, fleet: Fleet | None = None
) -> dict[str, Any]:
    """The recorded history of run ``run_id`` as one JSON document (what ``fleet
    export`` prints; ``replay(history=)`` reads it): the run's row, its steps, its
    transcripts, the signals sent to it, its child runs' ends, its spend and the large
    values they reference, each value as the store keeps it (a secret by its name only).
    Read-only, from ``database_url``, else ``fleet``'s store, else the environment's
    (``FLEET_DATABASE_URL``). ``UnknownRun`` if the store has no such run."""
    if database_url is None:
        database_url = (fleet.settings if fleet else Settings.from_env()).database_url
    queries = Queries(read_only(database_url))
    try:
        document = exports.export_run(queries, run_id)
    finally:
        queries.db.dispose()
    if document is None:
        raise UnknownRun(f"no run {run_id!r} in the store")
    return document


class _Given(Registry):
    """The registry of a replay given a workflow and no Fleet: the steps and child
    workflows the workflow hands over are taken as they come."""

    def step(self, ref: str | StepDef) -> StepDef:
        if isinstance(ref, StepDef):
            return self.steps.setdefault(ref.name, ref)
        return super().step(ref)

    def workflow(self, ref: str | WorkflowDef) -> WorkflowDef:
        if isinstance(ref, WorkflowDef):
            return self.workflows.setdefault(ref.name, ref)
        return super().workflow(ref)


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
