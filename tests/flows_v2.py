"""The next version of one test workflow, as a redeploy would ship it: same name,
version 2. A worker started with this module must leave version-1 runs alone."""

from __future__ import annotations

from fleet import Fleet, StepContext, WorkflowContext
from tests.flows import log_event

fleet = Fleet("testflows")
celery_app = fleet.celery


@fleet.step
def stamp(ctx: StepContext, label: str) -> str:
    log_event(ctx, "start")
    return f"{label} by v2"


@fleet.workflow(version="2")
def pinned(wf: WorkflowContext, label: str) -> str:
    return str(wf.step(stamp, label))
