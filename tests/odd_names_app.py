"""An application whose names use every character a queue's name may hold (the
workflow's name and version) and a step name a queue never carries (spaces, markup):
a real worker runs it on either broker (tests/e2e/test_queue_names.py)."""

from __future__ import annotations

from fleet import Fleet, StepContext, WorkflowContext

fleet = Fleet("odd")

WORKFLOW, VERSION, STEP = "odd.Names-v_2", "2026.01-rc_1", "look up [x] now"


@fleet.step(name=STEP)
def look_up(ctx: StepContext, n: int) -> int:
    return n + 1


@fleet.workflow(name=WORKFLOW, version=VERSION)
def odd_names(wf: WorkflowContext, n: int) -> int:
    return int(wf.step(look_up, n))
