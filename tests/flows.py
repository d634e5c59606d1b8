"""Workflows the tests run on real workers. Each step execution is appended to the
file named by FLEET_TEST_LOG, outside the store, so tests can count executions."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from fleet import Fleet, NonRetryable, RetryPolicy, StepContext, WorkflowContext

fleet = Fleet("testflows")
celery_app = fleet.celery


def log_event(ctx: StepContext, event: str, **extra: Any) -> None:
    path = os.environ.get("FLEET_TEST_LOG")
    if not path:
        return
    line = json.dumps(
        {
            "run": ctx.run_id,
            "step": ctx.step_id,
            "epoch": ctx.epoch,
            "attempt": ctx.attempt,
            "pid": os.getpid(),
            "event": event,
            **extra,
        }
    )
    # O_APPEND writes of one short line are atomic across processes.
    with open(path, "a") as f:
        f.write(line + "\n")


@fleet.step(retry=RetryPolicy(max_attempts=5, initial_delay=0.1, max_delay=1.0))
def work(ctx: StepContext, i: int, seconds: float = 0.0, hold: float = 0.0) -> dict[str, Any]:
    """Square ``i``. With ``hold``, the first attempt lingers that long (to be killed or frozen)."""
    log_event(ctx, "start", i=i)
    if hold and ctx.attempt == 1:
        time.sleep(hold)
    time.sleep(seconds)
    log_event(ctx, "end", i=i)
    return {"i": i, "value": i * i, "epoch": ctx.epoch}


@fleet.step
def linger(ctx: StepContext, first: float, later: float) -> dict[str, Any]:
    """Sleeps ``first`` seconds on attempt 1 and ``later`` on every other attempt."""
    log_event(ctx, "start")
    time.sleep(first if ctx.attempt == 1 else later)
    log_event(ctx, "end")
    return {"epoch": ctx.epoch}


@fleet.step
def square(ctx: StepContext, item: list[float]) -> int:
    """One fan-out item: ``[i, seconds]`` → i², after ``seconds``."""
    i, seconds = int(item[0]), float(item[1])
    log_event(ctx, "start", i=i)
    time.sleep(seconds)
    log_event(ctx, "end", i=i)
    return i * i


@fleet.step
def other(ctx: StepContext, i: int) -> int:
    log_event(ctx, "start", i=i)
    return -i


@fleet.step
def refuse(ctx: StepContext, why: str) -> None:
    log_event(ctx, "start")
    raise NonRetryable(why)


@fleet.workflow(version="1")
def chain(
    wf: WorkflowContext, n: int, seconds: float = 0.0, hold_at: int = -1, hold: float = 0.0
) -> int:
    """n sequential steps; step ``hold_at`` (0-based) holds its first attempt."""
    total = 0
    for i in range(n):
        out = wf.step(work, i, seconds, hold if i == hold_at else 0.0)
        total += out["value"]
    return total


@fleet.workflow(version="1")
def fan(wf: WorkflowContext, n: int, seconds: float = 0.0) -> dict[str, Any]:
    """A fan-out of n parallel steps, then one more step over their sum."""
    outs = wf.map(square, [[i, seconds] for i in range(n)])
    total = sum(outs)
    last = wf.step(work, total)
    return {"total": total, "last": last["value"], "n": len(outs)}


@fleet.workflow(version="1")
def frozen(wf: WorkflowContext, first: float, later: float) -> int:
    """work, then a step whose first attempt outlasts its lease, then work again."""
    wf.step(work, 1)
    held = wf.step(linger, first, later)
    wf.step(work, 2)
    return int(held["epoch"])


@fleet.workflow(version="1")
def drifting(wf: WorkflowContext, marker: str) -> int:
    """Deterministic only while ``marker`` does not change between replays."""
    wf.step(work, 1)
    if os.path.exists(marker):
        return int(wf.step(other, 2))
    return int(wf.step(work, 2)["value"])


@fleet.workflow(version="1")
def values(wf: WorkflowContext) -> dict[str, float]:
    """now() and random() are recorded: replays after the step see the same values."""
    t, r = wf.now(), wf.random()
    wf.step(work, 1)
    return {"now": t, "random": r, "now_again": wf.now()}


@fleet.workflow(version="1")
def guarded(wf: WorkflowContext) -> str:
    from fleet import StepFailed

    try:
        wf.step(refuse, "permission denied")
    except StepFailed as exc:
        return f"caught {exc.step_id}"
    return "unreachable"
