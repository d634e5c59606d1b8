"""Workflows for benchmarks 3 (I/O-bound agents) and 5 (cost of waiting) of issue #7.

Workers load this module: ``python -m fleet worker -A bench.agent_flows --pool threads``.
Settings come from the ``FLEET_*`` environment the benchmark gives each process; the
benchmark itself binds the same registry to its throwaway store with ``bind``.
"""

from __future__ import annotations

import time
from typing import Any

from fleet import Fleet, RetryPolicy, Settings, StepContext, WorkflowContext

fleet = Fleet("benchagents", default_retry=RetryPolicy(max_attempts=3, initial_delay=0.1))
celery_app = fleet.celery


def bind(env: dict[str, str]) -> Fleet:
    """This module's workflows bound to the store and broker named in ``env``."""
    return fleet.with_settings(Settings.from_env(env))


# --- benchmark 3: I/O-bound agents ----------------------------------------------------


@fleet.step
def model_call(ctx: StepContext, i: int, seconds: float) -> int:
    """A stand-in for a model call: ``seconds`` of blocking I/O (``time.sleep``, which
    gevent's monkey-patching turns into a cooperative wait)."""
    time.sleep(seconds)
    return i


@fleet.workflow
def agent(wf: WorkflowContext, steps: int, seconds: float) -> int:
    """An agent loop: ``steps`` model calls, one after another."""
    for i in range(steps):
        wf.step(model_call, i, seconds)
    return steps


# --- benchmark 5: the cost of waiting -------------------------------------------------


@fleet.step
def noop(ctx: StepContext, tag: str) -> str:
    """Nothing: the run's progress is read from the store's timestamps."""
    return tag


@fleet.workflow
def approval(wf: WorkflowContext) -> Any:
    """One step, a wait for the signal ``go`` (no timeout), one step."""
    wf.step(noop, "before")
    payload = wf.wait_for("go")
    wf.step(noop, "after")
    return payload
