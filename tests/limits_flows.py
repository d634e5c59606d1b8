"""Workflows under fleet-wide limits, run by the limits tests on real workers
(``-A tests.limits_flows``). The stand-in provider is a file: each call appends its
enter and exit (with time and pid) to FLEET_TEST_PROVIDER, so a test can find the most
calls that were ever inside at once."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from fleet import Fleet, Retry, RetryPolicy, StepContext, WorkflowContext
from fleet.llm import recording

fleet = Fleet("limitflows")
celery_app = fleet.celery

fleet.limit("api", concurrency=2)
fleet.limit("solo", concurrency=1)
fleet.limit("per-tenant", concurrency=1, per_tenant=True)
fleet.limit("busy", concurrency=5)
fleet.limit("tokens", tokens_per_minute=100)
fleet.limit("provider", requests_per_minute=1000)


def _record(ctx: StepContext, event: str, **extra: Any) -> None:
    path = os.environ.get("FLEET_TEST_PROVIDER")
    if not path:
        return
    line = {"run": ctx.run_id, "step": ctx.step_id, "attempt": ctx.attempt, "event": event}
    line.update(pid=os.getpid(), t=time.time(), **extra)
    with open(path, "a") as f:  # one short O_APPEND line: atomic across processes
        f.write(json.dumps(line) + "\n")


def _call(ctx: StepContext, limit: str, seconds: float, **extra: Any) -> str:
    _record(ctx, "enter", limit=limit, **extra)
    time.sleep(seconds)
    _record(ctx, "exit", limit=limit, **extra)
    return ctx.step_id


@fleet.step(limits=["api"])
def call_api(ctx: StepContext, i: int, seconds: float) -> str:
    return _call(ctx, "api", seconds, i=i)


@fleet.workflow
def fan_api(wf: WorkflowContext, n: int, seconds: float) -> list[str]:
    """``n`` calls in one fan-out: every one asks for the limit at once."""
    return list(wf.map(call_api_pair, [[i, seconds] for i in range(n)]))


@fleet.step(limits=["api"])
def call_api_pair(ctx: StepContext, item: list[Any]) -> str:
    return _call(ctx, "api", float(item[1]), i=int(item[0]))


@fleet.workflow
def one_api(wf: WorkflowContext, i: int, seconds: float) -> str:
    """One call, then a second: sequential, so the second would run inline."""
    first = wf.step(call_api, i, seconds)
    wf.step(call_api, i + 100, seconds)
    return str(first)


@fleet.step(limits=["api"])
async def acall_api(ctx: StepContext, i: int, seconds: float) -> str:
    """``call_api`` as an ``async def``: on Postgres its attempt runs on the event loop's
    own thread, its limiter calls off it."""
    _record(ctx, "enter", limit="api", i=i)
    await asyncio.sleep(seconds)
    _record(ctx, "exit", limit="api", i=i)
    return ctx.step_id


@fleet.workflow
def aone_api(wf: WorkflowContext, i: int, seconds: float) -> str:
    """Two async calls one after another (the second sent: a step naming limits takes
    room before its lease, on a slot)."""
    first = wf.step(acall_api, i, seconds)
    wf.step(acall_api, i + 100, seconds)
    return str(first)


@fleet.step(limits=["solo"], retry=RetryPolicy(max_attempts=5, initial_delay=0.1))
def hold_solo(ctx: StepContext, i: int, hang: float) -> str:
    """Lingers ``hang`` seconds on its first attempt (to have its worker killed there)."""
    _record(ctx, "enter", limit="solo", i=i)
    if ctx.attempt == 1:
        time.sleep(hang)
    time.sleep(0.2)
    _record(ctx, "exit", limit="solo", i=i)
    return f"solo-{i}"


@fleet.workflow
def solo(wf: WorkflowContext, i: int, hang: float) -> str:
    return str(wf.step(hold_solo, i, hang))


@fleet.step(limits=["per-tenant"])
def tenant_call(ctx: StepContext, item: list[Any]) -> str:
    return _call(ctx, "per-tenant", float(item[1]), i=int(item[0]))


@fleet.workflow
def tenant_run(wf: WorkflowContext, n: int, seconds: float) -> list[str]:
    return list(wf.map(tenant_call, [[i, seconds] for i in range(n)]))


@fleet.step(limits=["busy"], retry=RetryPolicy(max_attempts=3, initial_delay=0.05))
def rate_limited(ctx: StepContext, pause: float) -> str:
    """The provider answers 429 with Retry-After ``pause`` on every call."""
    _record(ctx, "enter", limit="busy")
    raise Retry(pause, "429 from the stand-in provider", limit="busy")


@fleet.workflow
def gets_429(wf: WorkflowContext, pause: float) -> str:
    return str(wf.step(rate_limited, pause))


class _RateLimitError(Exception):
    """What an OpenAI-compatible client raises on a 429 (``status_code``, ``response``)."""

    status_code = 429

    def __init__(self, wait_ms: int) -> None:
        super().__init__("Error code: 429 - rate limit reached")
        self.response = type("Response", (), {"headers": {"retry-after-ms": str(wait_ms)}})()


class _Throttled:
    """A client whose every chat completion is refused with a 429."""

    def __init__(self, wait_ms: int) -> None:
        self.chat, self.completions, self.wait_ms = self, self, wait_ms

    def create(self, **kwargs: Any) -> Any:
        raise _RateLimitError(self.wait_ms)


@fleet.step(limits=["busy", "provider"], retry=RetryPolicy(max_attempts=1))
def model_call(ctx: StepContext, wait_ms: int) -> str:
    llm = recording(_Throttled(wait_ms), ctx)
    return str(llm.chat.completions.create(model="m", messages=[]))


@fleet.workflow
def llm_429(wf: WorkflowContext, wait_ms: int) -> str:
    return str(wf.step(model_call, wait_ms))


@fleet.step(limits=["busy"])
def busy_call(ctx: StepContext, i: int) -> str:
    return _call(ctx, "busy", 0.05, i=i)


@fleet.workflow
def busy_one(wf: WorkflowContext, i: int) -> str:
    return str(wf.step(busy_call, i))


@fleet.step
def free_call(ctx: StepContext, i: int) -> str:
    """Names no limit."""
    return _call(ctx, "none", 0.05, i=i)


@fleet.workflow
def free_run(wf: WorkflowContext, i: int) -> str:
    return str(wf.step(free_call, i))


@fleet.step(limits=["tokens"], tokens=lambda estimate, used: estimate)
def spend(ctx: StepContext, estimate: int, used: int) -> int:
    """Reserves ``estimate`` tokens, reports ``used``."""
    ctx.record_usage(model="stand-in", input_tokens=used // 2, output_tokens=used - used // 2)
    _record(ctx, "enter", limit="tokens")
    _record(ctx, "exit", limit="tokens")
    return used


@fleet.workflow
def spend_three(wf: WorkflowContext, estimate: int, used: int) -> int:
    """Three calls in a row, each reserving ``estimate`` of a limit of 100 a minute."""
    return sum(int(wf.step(spend, estimate, used)) for _ in range(3))
