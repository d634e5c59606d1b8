"""The fleet application the throughput benchmarks run: one no-op step and workflows of
no-op steps, so that what is measured is the engine (store, broker, replay), not work.

Workers load it as ``python -m fleet worker -A bench.noop_flows``; settings come from
the ``FLEET_*`` environment like any fleet application."""

from __future__ import annotations

from fleet import Fleet
from fleet.worker.context import StepContext
from fleet.worker.workflow import WorkflowContext

fleet = Fleet("bench")


@fleet.step
def noop(ctx: StepContext, i: int) -> int:
    """Does nothing; returns its argument so the replay has a value to hand back."""
    return i


@fleet.workflow
def seq(wf: WorkflowContext, n: int) -> int:
    """``n`` sequential no-op steps."""
    for i in range(n):
        wf.step(noop, i)
    return n


@fleet.workflow
def ten(wf: WorkflowContext) -> int:
    """Ten sequential no-op steps: the unit of the many-runs benchmark."""
    for i in range(10):
        wf.step(noop, i)
    return 10
