"""The fleet application of the subagent benchmark (issue #16): a run of ten no-op steps,
and a parent that starts ``n`` of them as child runs at once and waits for them all.

Workers load it as ``python -m fleet worker -A bench.child_flows``."""

from __future__ import annotations

from fleet import Fleet
from fleet.worker.context import StepContext
from fleet.worker.workflow import WorkflowContext

fleet = Fleet("benchkids")
STEPS = 10


@fleet.step
def noop(ctx: StepContext, i: int) -> int:
    """Does nothing; returns its argument so the replay has a value to hand back."""
    return i


@fleet.workflow
def ten(wf: WorkflowContext) -> int:
    """Ten sequential no-op steps: one subagent's work, or one independent run's."""
    for i in range(STEPS):
        wf.step(noop, i)
    return STEPS


@fleet.workflow
def parent(wf: WorkflowContext, children: int) -> int:
    """``children`` runs of ``ten`` started at once as children, each awaited."""
    handles = [wf.start_child(ten, key=f"kid-{i}") for i in range(children)]
    return sum(h.result() for h in handles)
