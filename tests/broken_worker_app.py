"""An application whose worker cannot start: a worker bootstep that raises, as a
broken plugin or a dependency missing at start would. Celery logs it as an
``Unrecoverable error`` and stops the worker; ``fleet worker`` must then exit non-zero."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from tests.flows import fleet


class BrokenStep(bootsteps.StartStopStep):
    def start(self, parent: Any) -> None:
        raise RuntimeError("this bootstep always fails")


fleet.celery.steps["worker"].add(BrokenStep)
