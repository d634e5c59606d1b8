"""An application defining a workflow whose name a broker cannot carry as a queue's
name (a space: Celery's filesystem transport refuses it, and its worker stopped with a
traceback). ``fleet worker -A tests.spaced_app`` must refuse it in one line instead."""

from __future__ import annotations

from fleet import Fleet, WorkflowContext

fleet = Fleet("spaced")


@fleet.workflow(name="my flow", version="1")
def spaced(wf: WorkflowContext) -> None:
    return None
