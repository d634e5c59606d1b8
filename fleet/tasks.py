"""The two Celery tasks. Thin: they check the message's shape and call the engine."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import Celery
from celery.signals import worker_shutting_down

from fleet.attempt import execute, release_leases
from fleet.dispatch import ADVANCE, EXECUTE
from fleet.replay import advance
from fleet.runtime import Runtime
from fleet.states import Incident

log = logging.getLogger("fleet.tasks")


def _ids(args: tuple[Any, ...], n: int) -> tuple[str, ...] | None:
    if len(args) != n or not all(isinstance(a, str) and a for a in args):
        return None
    return tuple(args)


def register(celery: Celery, rt: Runtime) -> None:
    """Bind the tasks to this app only (``shared=False``): Celery's default would bind
    them to every app in the process, so a second Fleet's tasks would reach the first
    Fleet's store."""

    def malformed(task: str, args: tuple[Any, ...]) -> None:
        detail = f"{task} with arguments {args!r:.200}"
        log.error("malformed message dropped: %s", detail)
        rt.ledger.incident(Incident.MALFORMED_MESSAGE, None, detail=detail)

    def on_shutdown(**_: Any) -> None:
        # Celery's warm shutdown stops taking work and waits for running tasks; we give
        # them until the soft deadline, then release their leases and leave.
        grace = rt.settings.shutdown_grace

        def deadline() -> None:
            released = release_leases(rt)
            log.warning(
                "shutdown deadline (%.1fs) passed: %d lease(s) released; exiting", grace, released
            )
            logging.shutdown()
            os._exit(0)

        timer = threading.Timer(grace, deadline)
        timer.daemon = True
        timer.start()

    worker_shutting_down.connect(on_shutdown, weak=False)

    @celery.task(name=ADVANCE, ignore_result=True, shared=False)
    def advance_task(*args: Any) -> None:
        ids = _ids(args, 1)
        if ids is None:
            return malformed(ADVANCE, args)
        advance(rt, ids[0])

    @celery.task(name=EXECUTE, ignore_result=True, shared=False)
    def execute_task(*args: Any) -> None:
        ids = _ids(args, 2)
        if ids is None:
            return malformed(EXECUTE, args)
        execute(rt, ids[0], ids[1])
