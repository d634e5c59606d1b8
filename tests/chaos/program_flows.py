"""The chaos programs' workers' app: ``fleet worker -A tests.chaos.program_flows`` serves
the workflow ``chaos_program``, which runs the program it is given
(``programs.interpret``), and the steps programs name, so workers need no code
generation. What each step computes is ``programs.perform``, which the model calls too.

Every step body appends ``start``/``end`` lines (run, step, epoch, attempt, pid, time)
to the file named by FLEET_CHAOS_LOG (tests.provider.append_event), as
tests/chaos/flows.py does, and sleeps FLEET_CHAOS_STEP_SECONDS (0 by default) first:
the output never depends on it. Steps under a limit also append ``enter``/``exit``
lines naming it to FLEET_CHAOS_LIMIT_LOG, so a checker can count overlap per limit.
The effect calls the stand-in provider (FLEET_TEST_PROVIDER) under its idempotency key
and reconciles with a lookup there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from fleet import Fleet, RetryPolicy, StepContext, WorkflowContext
from tests.chaos import programs as P
from tests.provider import append_event, provider_apply, provider_lookup

fleet = Fleet("chaos-programs")
celery_app = fleet.celery

fleet.limit(P.CONC_LIMIT, concurrency=P.CONCURRENCY)
TAKEOVER_HOLD = 2.0  # seconds a limited step's later attempt holds its slot longer
fleet.limit(P.RATE_LIMIT, requests_per_minute=P.RATE_PER_MINUTE)


def _policy(step: str) -> RetryPolicy:
    return RetryPolicy(max_attempts=P.cap(step), initial_delay=0.05, max_delay=0.5, jitter=False)


def _seconds() -> float:
    return float(os.environ.get("FLEET_CHAOS_STEP_SECONDS", "0"))


def _log(ctx: StepContext, event: str, **extra: Any) -> None:
    append_event("FLEET_CHAOS_LOG", ctx, event, **extra)


@contextlib.contextmanager
def _body(ctx: StepContext, limit: str | None = None) -> Iterator[None]:
    """Logs ``start`` (and ``enter``), sleeps the step time, runs the body, logs ``end``
    (ok or not; and ``exit``)."""
    _log(ctx, "start")
    if limit is not None:
        append_event("FLEET_CHAOS_LIMIT_LOG", ctx, "enter", limit=limit)
    ok, error = False, None
    try:
        time.sleep(_seconds())
        yield
        ok = True
    except BaseException as exc:  # named in the log: a LeaseLost attempt writes nothing
        error = type(exc).__name__
        raise
    finally:
        if limit is not None:
            append_event("FLEET_CHAOS_LIMIT_LOG", ctx, "exit", limit=limit)
        _log(ctx, "end", ok=ok, **({"error": error} if error else {}))


def _perform(ctx: StepContext, name: str, *args: Any) -> Any:
    return P.perform(name, args, ctx.step_id, ctx.attempt)


@fleet.step(retry=_policy("chaos_step"))
def chaos_step(ctx: StepContext, acc: int, k: int) -> int:
    with _body(ctx):
        return int(_perform(ctx, "chaos_step", acc, k))


async def _abody(ctx: StepContext, name: str, *args: Any) -> Any:
    """An ``async def`` step's body: on a threads worker its attempt goes on off its
    slot (fleet/worker/strands.py) while it awaits the step time."""
    _log(ctx, "start")
    ok = False
    try:
        await asyncio.sleep(_seconds())
        out = _perform(ctx, name, *args)
        ok = True
        return out
    finally:
        _log(ctx, "end", ok=ok)


@fleet.step(retry=_policy("chaos_astep"))
async def chaos_astep(ctx: StepContext, acc: int, k: int) -> int:
    return int(await _abody(ctx, "chaos_astep", acc, k))


@fleet.step(retry=_policy("chaos_fail"))
def chaos_fail(ctx: StepContext, acc: int, k: int, mode: str) -> int:
    with _body(ctx):
        return int(_perform(ctx, "chaos_fail", acc, k, mode))


@fleet.step(retry=_policy("chaos_afail"))
async def chaos_afail(ctx: StepContext, acc: int, k: int, mode: str) -> int:
    return int(await _abody(ctx, "chaos_afail", acc, k, mode))


@fleet.step(retry=_policy("chaos_item"))
def chaos_item(ctx: StepContext, item: list[Any]) -> int:
    with _body(ctx):
        return int(_perform(ctx, "chaos_item", item))


@fleet.step(effect=True, retry=_policy("chaos_effect"))
def chaos_effect(ctx: StepContext, acc: int, k: int) -> dict[str, Any]:
    """The effect: one call to the provider under the step's idempotency key."""
    with _body(ctx):
        body = str(_perform(ctx, "chaos_effect", acc, k))
        checked_at = time.time()
        ctx.heartbeat()  # a zombie woken after a takeover stops here (LeaseLost)
        # The lease was held at some moment after ``checked_at``: a freeze that lands
        # after that and before the call leaves a zombie the check cannot stop.
        _log(ctx, "call", checked_at=checked_at)
        return provider_apply(ctx.idempotency_key, body)


@chaos_effect.reconcile
def chaos_effect_lookup(ctx: StepContext) -> dict[str, Any] | None:
    return provider_lookup(ctx.idempotency_key)


@fleet.step(retry=_policy("chaos_summarize"))
def chaos_summarize(ctx: StepContext, messages: Any) -> str:
    with _body(ctx):
        return str(_perform(ctx, "chaos_summarize", list(messages)))


@fleet.step(retry=_policy("chaos_read"))
def chaos_read(ctx: StepContext, window: Any) -> int:
    """A step reading the transcript's window (a read-only view of the messages)."""
    with _body(ctx):
        return int(_perform(ctx, "chaos_read", list(window)))


@fleet.step(retry=_policy("chaos_conc"), limits=[P.CONC_LIMIT])
def chaos_conc(ctx: StepContext, item: list[int]) -> int:
    """A body inside the concurrency limit. An attempt after the first (one that took
    the step over from a frozen or killed worker: the step never fails by itself) holds
    its slot ``TAKEOVER_HOLD`` longer, so it is still inside when the zombie it
    replaced wakes and gives back a slot: if that could free the successor's slot, one
    body too many gets in, and the overlap check sees it."""
    with _body(ctx, P.CONC_LIMIT):
        if ctx.epoch > 1:
            time.sleep(TAKEOVER_HOLD)
        return int(_perform(ctx, "chaos_conc", item))


@fleet.step(retry=_policy("chaos_rate"), limits=[P.RATE_LIMIT])
def chaos_rate(ctx: StepContext, item: list[int]) -> int:
    with _body(ctx, P.RATE_LIMIT):
        # A rated limit counts a call that reported usage (or sent a request).
        ctx.record_usage(model="chaos-rate", input_tokens=1)
        return int(_perform(ctx, "chaos_rate", item))


@fleet.step(retry=_policy("chaos_hog"))
def chaos_hog(ctx: StepContext, acc: int, k: int) -> int:
    """Holds the GIL in one C call (``sum`` over a range): the worker's other threads
    and its event loop stand still meanwhile (its heartbeats too)."""
    with _body(ctx):
        return int(_perform(ctx, "chaos_hog", acc, k))


@fleet.step(retry=_policy("chaos_usage"))
def chaos_usage(ctx: StepContext, acc: int, tokens: int) -> int:
    """Spends ``tokens`` of the run's budget: past it, the run parks until raised."""
    with _body(ctx):
        ctx.record_usage(model="chaos-model", input_tokens=tokens)
        return int(_perform(ctx, "chaos_usage", acc, tokens))


@fleet.workflow(name=P.WORKFLOW, version="1")
def chaos_program(wf: WorkflowContext, prog: dict[str, Any]) -> dict[str, Any]:
    return P.interpret(wf, prog)
