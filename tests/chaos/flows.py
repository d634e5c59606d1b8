"""The chaos workload: one mixed workflow of ~16 steps — a sequential chain (its second
half ``async def``), a fan-out, a retry-then-succeed step and an effect against the
stand-in provider.

Every step body appends ``start``/``end`` lines (run, step, epoch, pid, time) to the
file named by FLEET_CHAOS_LOG, outside the store, so the harness can count executions
and time recoveries; the effect also a ``call`` line just before it calls the provider.
Step bodies sleep FLEET_CHAOS_STEP_SECONDS (0 in the fault-free reference run): the
output never depends on it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from fleet import Fleet, RetryPolicy, StepContext, WorkflowContext
from tests.provider import append_event, provider_apply, provider_lookup

fleet = Fleet("chaos")
celery_app = fleet.celery

# Generous caps: a worker killed mid-step costs that step an attempt, and the injector
# may kill the same step's worker more than once.
PATIENT = RetryPolicy(max_attempts=12, initial_delay=0.05, max_delay=0.5, jitter=False)


def _log(ctx: StepContext, event: str, **extra: Any) -> None:
    append_event("FLEET_CHAOS_LOG", ctx, event, **extra)


@contextlib.contextmanager
def _body(ctx: StepContext) -> Iterator[None]:
    """Logs ``start``, sleeps the step time, runs the body, logs ``end`` (ok or not):
    after an ``end`` the attempt writes its outcome to the store, fenced or not."""
    _log(ctx, "start")
    ok = False
    try:
        time.sleep(float(os.environ.get("FLEET_CHAOS_STEP_SECONDS", "0")))
        yield
        ok = True
    finally:
        _log(ctx, "end", ok=ok)


@fleet.step(retry=PATIENT)
def crunch(ctx: StepContext, acc: int, i: int) -> int:
    with _body(ctx):
        return (acc * 31 + i * 7 + 3) % 1_000_003


@fleet.step(retry=PATIENT)
async def acrunch(ctx: StepContext, acc: int, i: int) -> int:
    """``crunch`` awaited: on a threads worker its attempt goes on off its slot, as a
    greenlet on a strand (fleet/worker/strands.py), while it awaits the step time."""
    import asyncio

    _log(ctx, "start")
    ok = False
    try:
        await asyncio.sleep(float(os.environ.get("FLEET_CHAOS_STEP_SECONDS", "0")))
        ok = True
        return (acc * 31 + i * 7 + 3) % 1_000_003
    finally:
        _log(ctx, "end", ok=ok)


@fleet.step(retry=PATIENT)
def part(ctx: StepContext, item: list[int]) -> int:
    with _body(ctx):
        acc, k = item
        return (acc + k * k) % 9973


@fleet.step(retry=PATIENT)
def fetch(ctx: StepContext, acc: int) -> int:
    """Times out on its first attempt (a throttled provider), succeeds on the next."""
    with _body(ctx):
        if ctx.attempt == 1:
            raise TimeoutError("provider timed out")
        return acc // 7


@fleet.step(effect=True, retry=PATIENT)
def charge(ctx: StepContext, body: str) -> dict[str, Any]:
    """The effect: one call to the provider under the step's idempotency key."""
    with _body(ctx):
        checked_at = time.time()
        ctx.heartbeat()  # a zombie woken after a takeover stops here (LeaseLost)
        # The lease was held at some moment after ``checked_at``: a freeze that lands
        # after that and before the call leaves a zombie the check cannot stop.
        _log(ctx, "call", checked_at=checked_at)
        return provider_apply(ctx.idempotency_key, body)


@charge.reconcile
def charge_lookup(ctx: StepContext) -> dict[str, Any] | None:
    return provider_lookup(ctx.idempotency_key)


@fleet.workflow(version="1")
def mixed(wf: WorkflowContext, job: int, chain: int = 10, fan: int = 4) -> dict[str, Any]:
    acc = job
    for i in range(chain):
        # The chain's second half is async: killed, frozen and fenced off its slot too.
        acc = int(wf.step(crunch if i < chain // 2 else acrunch, acc, i))
    parts = [int(p) for p in wf.map(part, [[acc, k] for k in range(fan)])]
    fetched = int(wf.step(fetch, acc + sum(parts)))
    receipt = wf.step(charge, f"job {job}: charge {fetched % 1000}")
    return {"acc": acc, "parts": parts, "fetched": fetched, "charged": receipt["body"]}
