"""Workflows the tests run on real workers. Each step execution is appended to the
file named by FLEET_TEST_LOG, outside the store, so tests can count executions."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from fleet import (
    ChildFailed,
    DeadLetterInfo,
    Fleet,
    NonRetryable,
    Retry,
    RetryPolicy,
    Secret,
    StepContext,
    StepFailed,
    WorkflowContext,
)
from tests.provider import append_event, provider_apply, provider_lookup

fleet = Fleet("testflows")
celery_app = fleet.celery


def log_event(ctx: StepContext, event: str, **extra: Any) -> None:
    append_event("FLEET_TEST_LOG", ctx, event, **extra)


@fleet.step(retry=RetryPolicy(max_attempts=5, initial_delay=0.1, max_delay=1.0))
def work(ctx: StepContext, i: int, seconds: float = 0.0, hold: float = 0.0) -> dict[str, Any]:
    """Square ``i``. With ``hold``, the first attempt lingers that long (to be killed or frozen)."""
    # Usage first: a test that sees "start" knows this attempt's spend is recorded.
    ctx.record_usage(model="stand-in", input_tokens=10, output_tokens=i, cost=0.001)
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


@fleet.step
def nop(ctx: StepContext, i: int) -> int:
    return i


@fleet.workflow(version="1")
def nops(wf: WorkflowContext, n: int) -> int:
    """n sequential steps that do nothing and write nothing of their own."""
    return sum(wf.step(nop, i) for i in range(n))


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


# --- failure policy -------------------------------------------------------------------

FIXED = RetryPolicy(max_attempts=4, initial_delay=0.5, backoff=2.0, max_delay=5.0, jitter=False)


@fleet.on_dead_letter
def record_dead_letter(letter: DeadLetterInfo) -> None:
    """Logs each dead letter, then fails: a broken hook must not hurt the engine."""
    path = os.environ.get("FLEET_TEST_HOOK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "id": letter.id,
                        "run": letter.run_id,
                        "step": letter.step_id,
                        "error": letter.error,
                    }
                )
                + "\n"
            )
    raise RuntimeError("the pager is down")


@fleet.step(retry=FIXED)
def flaky(ctx: StepContext, failures: int) -> int:
    """Times out on its first ``failures`` attempts."""
    log_event(ctx, "start")
    if ctx.attempt <= failures:
        raise TimeoutError(f"provider timed out (attempt {ctx.attempt})")
    return ctx.attempt


@fleet.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.1, jitter=False))
def crash(ctx: StepContext) -> None:
    """Kills the process running it, every time."""
    log_event(ctx, "start")
    os._exit(1)


@fleet.step(retry=RetryPolicy(max_attempts=2, initial_delay=0.1, jitter=False))
def maybe(ctx: StepContext, item: list[Any]) -> int:
    """``[i, marker]``: item 3 fails until the marker file exists (the cause is fixed)."""
    i, marker = int(item[0]), str(item[1])
    log_event(ctx, "start", i=i)
    if i == 3 and not os.path.exists(marker):
        raise ValueError("upstream rejected item 3")
    return i * 10


@fleet.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.1, jitter=False))
def later(ctx: StepContext, delay: float) -> int:
    """Asks for a retry ``delay`` seconds out on its first attempt."""
    log_event(ctx, "start")
    if ctx.attempt == 1:
        raise Retry(delay=delay, reason="rate limited")
    return ctx.attempt


@fleet.workflow(version="1")
def retrying(wf: WorkflowContext, failures: int) -> int:
    return int(wf.step(flaky, failures))


@fleet.workflow(version="1")
def crashing(wf: WorkflowContext) -> None:
    wf.step(crash)


@fleet.workflow(version="1")
def refusing(wf: WorkflowContext) -> None:
    wf.step(refuse, "permission denied")


@fleet.workflow(version="1")
def fanout(wf: WorkflowContext, marker: str, tolerant: bool = False) -> list[Any]:
    outs = wf.map(maybe, [[i, marker] for i in range(5)], return_exceptions=tolerant)
    return [o if not isinstance(o, StepFailed) else f"failed: {o.step_id}" for o in outs]


@fleet.workflow(version="1")
def retry_later(wf: WorkflowContext, delay: float) -> int:
    return int(wf.step(later, delay))


# --- waiting ----------------------------------------------------------------------------


@fleet.workflow(version="1")
def approval(wf: WorkflowContext, timeout: float | None = None) -> dict[str, Any]:
    """work, then wait for a person's approval (or the timeout), then work again."""
    wf.step(work, 1)
    decision = wf.wait_for("approval", timeout=timeout)
    if decision and decision.get("approved"):
        wf.step(work, 2)
    return {"decision": decision}


@fleet.workflow(version="1")
def two_gates(wf: WorkflowContext) -> list[Any]:
    """Two approval gates, one after the other: each decision must answer its own."""
    first = wf.wait_for("approval")
    wf.step(work, 1)
    second = wf.wait_for("approval")
    return [first, second]


@fleet.workflow(version="1")
def inbox(wf: WorkflowContext, n: int) -> list[Any]:
    """Consume n signals named "msg", in order; a slow step first, so signals can
    arrive before the first wait."""
    wf.step(work, 0, 1.0)
    return [wf.wait_for("msg") for _ in range(n)]


@fleet.workflow(version="1")
def napper(wf: WorkflowContext, seconds: float) -> float:
    """work, a durable sleep, work; returns how long the sleep took by recorded clocks."""
    wf.step(work, 1)
    before = wf.now()
    wf.sleep(seconds)
    after = wf.now()
    wf.step(work, 2)
    return after - before


# --- effects ----------------------------------------------------------------------------
# The stand-in provider (tests/provider.py) records every call by idempotency key.


def _send(ctx: StepContext, body: str, die_after: bool) -> dict[str, Any]:
    log_event(ctx, "start")
    receipt = provider_apply(ctx.idempotency_key, body)
    if die_after and ctx.attempt == 1:
        os.kill(os.getpid(), 9)  # the effect reached the provider; the checkpoint did not
    return receipt


@fleet.step(effect=True, idempotent=True)
def send_idempotent(ctx: StepContext, body: str, die_after: bool = False) -> dict[str, Any]:
    return _send(ctx, body, die_after)


@fleet.step(effect=True)
def send_reconciled(ctx: StepContext, body: str, die_after: bool = False) -> dict[str, Any]:
    return _send(ctx, body, die_after)


@send_reconciled.reconcile
def send_reconciled_lookup(ctx: StepContext) -> dict[str, Any] | None:
    return provider_lookup(ctx.idempotency_key)


@fleet.step(effect=True)
def send_plain(ctx: StepContext, body: str, die_after: bool = False) -> dict[str, Any]:
    return _send(ctx, body, die_after)


@fleet.workflow(version="1")
def notify(wf: WorkflowContext, how: str, body: str, die_after: bool = False) -> dict[str, Any]:
    sender = {"idempotent": send_idempotent, "reconciled": send_reconciled, "plain": send_plain}[
        how
    ]
    wf.step(work, 1)
    return dict(wf.step(sender, body, die_after))


# --- pinning ----------------------------------------------------------------------------


@fleet.step
def stamp(ctx: StepContext, label: str) -> str:
    log_event(ctx, "start")
    return f"{label} by v1"


@fleet.workflow(version="1", pins={"model": "example-model-2026-10"})
def pinned(wf: WorkflowContext, label: str) -> str:
    return str(wf.step(stamp, label))


# --- payload hygiene --------------------------------------------------------------------


@fleet.step
def big(ctx: StepContext, size: int) -> str:
    log_event(ctx, "start")
    return "x" * size


@fleet.workflow(version="1")
def large(wf: WorkflowContext, size: int) -> dict[str, Any]:
    """A large output twice: stored once by content hash, read back whole."""
    first, second = wf.step(big, size), wf.step(big, size)
    return {"len": len(first), "same": first == second}


@fleet.step
def use_secret(ctx: StepContext, key: Secret, leak: bool = False) -> Any:
    """Uses the secret; with ``leak`` tries to return its value wrapped (fleet refuses)."""
    log_event(ctx, "start")
    value = key.reveal()
    return Secret(value) if leak else {"length": len(value), "repr": repr(key)}


@fleet.workflow(version="1")
def secretive(wf: WorkflowContext, leak: bool = False) -> Any:
    return wf.step(use_secret, Secret.env("FLEET_TEST_SECRET"), leak)


# --- spend ------------------------------------------------------------------------------


@fleet.step
def spend(ctx: StepContext, i: int) -> int:
    """Records 10 tokens as soon as it starts, then works a little."""
    ctx.record_usage(model="stand-in", input_tokens=5, output_tokens=5, cost=0.01)
    log_event(ctx, "start", i=i)
    time.sleep(0.3)
    return i


@fleet.workflow(version="1")
def spender(wf: WorkflowContext, n: int) -> int:
    return sum(wf.map(spend, range(n)))


@fleet.workflow(version="1", budget={"cost": 0.01})
def thrifty(wf: WorkflowContext) -> int:
    """A workflow-level default budget: the first step's spend reaches it."""
    return int(wf.step(spend, 1)) + int(wf.step(spend, 2))


@fleet.step
def ask_llm(ctx: StepContext, prompt: str) -> str:
    """One chat completion from an OpenAI-compatible server, usage recorded by fleet.llm."""
    from openai import OpenAI

    from fleet.llm import recording

    client = OpenAI(base_url=os.environ["FLEET_TEST_LLM_URL"], api_key="stub", max_retries=0)
    llm = recording(client, ctx, prices={"stub-model": (0.000001, 0.000002)})
    reply = llm.chat.completions.create(
        model="stub-model", messages=[{"role": "user", "content": prompt}]
    )
    return str(reply.choices[0].message.content)


@fleet.workflow(version="1")
def asker(wf: WorkflowContext, prompts: list[str]) -> list[str]:
    return [str(wf.step(ask_llm, p)) for p in prompts]


# --- worker pools -----------------------------------------------------------------------


@fleet.step
def pool_probe(ctx: StepContext) -> dict[str, bool]:
    """Whether blocking calls in this worker yield to other steps (gevent's patches)."""
    import sys

    if "gevent.monkey" not in sys.modules:
        return {"time": False, "socket": False}
    from gevent import monkey

    return {"time": monkey.is_module_patched("time"), "socket": monkey.is_module_patched("socket")}


@fleet.workflow(version="1")
def probe(wf: WorkflowContext) -> dict[str, bool]:
    return dict(wf.step(pool_probe))


# --- hostile input and secrets (issue 13) -------------------------------------------------


@fleet.step
def echo(ctx: StepContext, value: Any, **extra: Any) -> dict[str, Any]:
    """Hands back exactly what it was given."""
    return {"value": value, "extra": extra}


@fleet.workflow(version="1")
def echo_back(wf: WorkflowContext, value: Any, **extra: Any) -> dict[str, Any]:
    """What the workflow was given and what its step was given: both unchanged."""
    return {"workflow": {"value": value, "extra": extra}, "step": wf.step(echo, value, **extra)}


@fleet.step(retry=RetryPolicy(max_attempts=2, initial_delay=0.1, jitter=False))
def quote_secret(ctx: StepContext, key: Secret, how: str) -> None:
    """Logs and fails quoting the secret's value: in the exception's message
    ("message"), only in the exception it chains from and a note ("cause"), or read
    from the environment without ``reveal`` ("environ")."""
    import logging

    log_event(ctx, "start")
    value = os.environ[str(key.name)] if how == "environ" else key.reveal()
    logging.getLogger("tests.flows").warning("calling the API with %s", value)
    if how == "cause":
        try:
            raise PermissionError(f"key {value} was refused")
        except PermissionError as exc:
            failure = RuntimeError("the API call failed")
            failure.add_note(f"tried {value}")
            raise failure from exc
    raise ValueError(f"the API refused key {value!r}")


@fleet.workflow(version="1")
def leaky_secret(wf: WorkflowContext, how: str) -> None:
    """``quote_secret``; with how="workflow", the workflow itself quotes the value; with
    how="later", it reveals it, runs a step, and quotes it in a later advance."""
    key = Secret.env("FLEET_TEST_SECRET")
    if how == "workflow":
        raise ValueError(f"the workflow saw {key.reveal()}")
    if how == "later":
        seen = key.reveal()
        wf.step(nop, 1)
        raise ValueError(f"the workflow saw {seen} before its step")
    wf.step(quote_secret, key, how)


@fleet.workflow(version="1")
def misuses_fleet(wf: WorkflowContext, how: str) -> None:
    """A workflow whose own code raises one of fleet's errors: a bug to fail the run
    on, not a store outage to retry forever."""
    if how == "unknown-step":
        wf.step("no_such_step")
    raise NonRetryable("the workflow gave up")


@fleet.step
def hear(ctx: StepContext, chat: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": f"heard {len(chat)}: {chat[-1]['content']}"}


@fleet.step
def gist(ctx: StepContext, messages: Any) -> str:
    return "gist: " + " / ".join(str(m.get("content")) for m in messages)


@fleet.workflow(version="1")
def talks(wf: WorkflowContext, wait: bool = False, text: str = "hello") -> int:
    """A transcript, a step given it, a compaction; ``wait``: then waits for approval."""
    chat = wf.transcript()
    chat.append({"role": "user", "content": text})
    chat.append(wf.step(hear, chat))
    wf.compact(chat, gist, keep_last=1)
    if wait:
        wf.wait_for("approval")
    return len(chat.window())


@fleet.step
def model_turn(ctx: StepContext, chat: Any, turn: int) -> dict[str, Any]:
    """A model's turn over the transcript: asks to read a note twice, then answers."""
    if turn < 2:
        call = {"name": "read_note", "arguments": json.dumps({"path": f"notes/{turn}.md"})}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"call_read_{turn}", "type": "function", "function": call}],
        }
    return {"role": "assistant", "content": f"done, having read {len(chat)} messages"}


@fleet.step
def read_note(ctx: StepContext, path: str) -> str:
    return f"contents of {path}"


@fleet.step(effect=True, idempotent=True)
def file_report(ctx: StepContext, text: str) -> str:
    return f"filed as {ctx.idempotency_key}"


@fleet.workflow(version="1")
def tool_agent(wf: WorkflowContext, notes: int = 0, summarize_at: int = 0) -> str:
    """A tool-using agent as the README builds one: model turns given the transcript,
    each tool call a step keyed by its call id, an effect at the end. ``notes`` more
    user messages first; ``summarize_at``: a compaction keeping the rest after that."""
    chat = wf.transcript()
    chat.append({"role": "user", "content": "read my notes"})
    for i in range(notes):
        chat.append({"role": "user", "content": f"note {i}"})
    if summarize_at:
        wf.compact(chat, gist, keep_last=len(chat) - summarize_at)
    reply: dict[str, Any] = {}
    for turn in range(3):
        reply = wf.step(model_turn, chat, turn)
        chat.append(reply)
        for call in reply.get("tool_calls") or []:
            path = json.loads(call["function"]["arguments"])["path"]
            chat.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": wf.step(read_note, path, key=call["id"]),
                }
            )
    return str(wf.step(file_report, reply["content"]))


# --- the model pinned per run (fleet.llm) -----------------------------------------------

PINNED_MODEL = "example-model-2026-10"


class FakeProvider:
    """An OpenAI-compatible client standing in for the provider: every chat completion
    costs 7 + 3 tokens, answered under the model asked for; each request that reaches
    it is logged ("provider-call"), so a test sees which were never sent."""

    def __init__(self, ctx: StepContext) -> None:
        self._ctx = ctx
        self.chat = self
        self.completions = self

    def create(self, **kwargs: Any) -> dict[str, Any]:
        log_event(self._ctx, "provider-call", model=kwargs.get("model"))
        return {
            "model": kwargs.get("model"),
            "choices": [{"message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3},
        }


@fleet.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.1, max_delay=0.5))
def pinned_turn(ctx: StepContext, models: list[str | None]) -> list[str]:
    """One request per entry of ``models`` (None: the request names no model), through
    fleet.llm.recording; returns the model each reply came from."""
    from fleet.llm import recording

    log_event(ctx, "start", pins=ctx.pins)
    llm = recording(FakeProvider(ctx), ctx, prices={PINNED_MODEL: (0.001, 0.002)})
    replies = []
    for model in models:
        named = {} if model is None else {"model": model}
        reply = llm.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **named)
        replies.append(str(reply["model"]))
    return replies


@fleet.workflow(version="1", pins={"model": PINNED_MODEL})
def pinned_chat(wf: WorkflowContext, later_model: str) -> list[list[str]]:
    """A turn naming no model, then one that names ``later_model`` after another request
    naming none (so the later attempt has spent before it asks)."""
    return [wf.step(pinned_turn, [None]), wf.step(pinned_turn, [None, later_model])]


# --- fan-outs that settle before they raise (lead) ------------------------------------


def _branch(ctx: StepContext, item: list[Any]) -> int:
    """``[i, seconds, bad]``: takes ``seconds``; an ``i`` in ``bad`` fails at once (not retried)."""
    i, seconds, bad = int(item[0]), float(item[1]), list(item[2])
    log_event(ctx, "start", i=i)
    if i in bad:
        raise NonRetryable(f"item {i} is bad")
    time.sleep(seconds)
    log_event(ctx, "end", i=i)
    return i


@fleet.step(retry=RetryPolicy(max_attempts=1))
def branch(ctx: StepContext, item: list[Any]) -> int:
    """One branch of a fan-out (see ``_branch``)."""
    return _branch(ctx, item)


@fleet.step(retry=RetryPolicy(max_attempts=1))
def other_branch(ctx: StepContext, item: list[Any]) -> str:
    """A second kind of branch for wf.parallel: the same, its result a string."""
    return f"#{_branch(ctx, item)}"


@fleet.workflow(version="1")
def settling(
    wf: WorkflowContext, how: str, n: int, seconds: float, bad: list[int], tolerant: bool = False
) -> dict[str, Any]:
    """``n`` branches by ``map`` or by ``parallel`` (alternating two step kinds); a failure
    is caught and reported, with every branch it names."""
    try:
        if how == "map":
            outs = wf.map(branch, [[i, seconds, bad] for i in range(n)], return_exceptions=tolerant)
        elif how == "bare":  # a mistake: the step itself, not a wf.call description of it
            outs = wf.parallel(*[branch] * n)
        else:
            calls = [
                wf.call(other_branch if i % 2 else branch, [i, seconds, bad], key=f"tool-{i}")
                for i in range(n)
            ]
            outs = wf.parallel(*calls, return_exceptions=tolerant)
    except StepFailed as exc:
        failures = getattr(exc, "failures", [exc])
        return {"failed": str(exc), "dead": [f.step_id for f in failures]}
    return {"ok": [o if not isinstance(o, StepFailed) else f"dead {o.step_id}" for o in outs]}


@fleet.workflow(version="1")
def sprawling(wf: WorkflowContext, n: int) -> int:
    """``n`` steps one after another (FLEET_MAX_STEPS)."""
    return sum(wf.step(branch, [i, 0.0, []]) for i in range(n))


# --- children (brief C) ------------------------------------------------------------


@fleet.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.1, max_delay=0.5))
def gate(ctx: StepContext, path: str) -> int:
    """Blocks until the file ``path`` exists (at most 60 s): a step to cancel mid-run."""
    log_event(ctx, "start", path=path)
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    log_event(ctx, "end", path=path)
    return ctx.epoch


@fleet.workflow(version="1")
def kid(wf: WorkflowContext, i: int, seconds: float = 0.0, hold: float = 0.0) -> int:
    """A child: one ``work`` step (it records 10 + i tokens), its value."""
    return int(wf.step(work, i, seconds, hold)["value"])


@fleet.workflow(version="1")
def gated_kid(wf: WorkflowContext, path: str) -> int:
    return int(wf.step(gate, path))


@fleet.workflow(version="1")
def failing_kid(wf: WorkflowContext, why: str) -> None:
    wf.step(refuse, why)


@fleet.workflow(version="1")
def parent(
    wf: WorkflowContext, i: int, hold: float = 0.0, key: str | None = None, catch: bool = False
) -> dict[str, Any]:
    """A step, a child (``kid``, or ``failing_kid`` for i < 0), a step."""
    before = wf.step(work, 1)["value"]
    try:
        if i < 0:
            got = wf.child(failing_kid, "no", key=key)
        else:
            got = wf.child(kid, i, 0.0, hold, key=key, budget={"tokens": 500})
    except ChildFailed as exc:
        if not catch:
            raise
        got = {
            "caught": str(exc),
            "step": exc.step_id,
            "is_step_failed": isinstance(exc, StepFailed),
        }
    after = wf.step(other, 3)
    return {"before": before, "child": got, "after": after}


@fleet.workflow(version="1")
def brood(wf: WorkflowContext, n: int, seconds: float = 0.0) -> list[int]:
    """``n`` children started at once, then waited on."""
    handles = [wf.start_child(kid, i, seconds, key=f"kid-{i}") for i in range(n)]
    return [int(h.result()) for h in handles]


@fleet.workflow(version="1")
def gated_brood(wf: WorkflowContext, n: int, path: str) -> list[int]:
    handles = [wf.start_child(gated_kid, path, key=f"g{i}") for i in range(n)]
    return [int(h.result()) for h in handles]


@fleet.workflow(version="1")
def deserter(wf: WorkflowContext, path: str) -> str:
    """Starts two gated children, one detached, and ends without waiting for either."""
    wf.start_child(gated_kid, path, key="attached")
    wf.start_child(gated_kid, path, key="detached", detached=True)
    return "gone"


@fleet.workflow(version="1")
def mixed(wf: WorkflowContext) -> list[Any]:
    """A parallel tool call whose second branch is a child run."""
    return wf.parallel(wf.call(other, 2), wf.call(kid, 3, key="sub"))


# --- trees of runs under retention (issue 48, item 2) ----------------------------------


@fleet.workflow(version="1")
def scout_then_wait(wf: WorkflowContext) -> list[int]:
    """A child (``kid`` 91: 101 tokens), a wait for "go", then two ``work`` 91 steps
    (101 tokens each): under a budget of 150 tokens, the first starts (101 spent, the
    child's) and the second does not (202)."""
    got = [int(wf.child(kid, 91, key="scout"))]
    wf.wait_for("go")
    return got + [int(wf.step(work, 91)["value"]) for _ in range(2)]


@fleet.workflow(version="1")
def lineage(wf: WorkflowContext, depth: int, detached_at: int = -1) -> int:
    """A chain of runs ``depth`` children deep below this one, each a ``lineage`` one
    shallower, the last a ``work`` step; the child at ``detached_at`` is detached."""
    if depth <= 0:
        return int(wf.step(work, 1)["value"])
    child = wf.start_child(
        lineage, depth - 1, detached_at, key="heir", detached=depth == detached_at
    )
    return int(child.result()) + 1


@fleet.workflow(version="1")
def abandoner(wf: WorkflowContext) -> str:
    """Starts a detached child that waits for "go", and ends without waiting for it."""
    wf.start_child(awaiting_kid, 2, True, key="stray", detached=True)
    return "left"


# --- fan-out scaling (brief F) --------------------------------------------------------


@fleet.step(retry=RetryPolicy(max_attempts=1))
def tally(ctx: StepContext, item: list[Any]) -> int:
    """One branch: ``[i, bad]`` → i; an i in ``bad`` fails (not retried)."""
    i, bad = int(item[0]), list(item[1])
    if i in bad:
        raise NonRetryable(f"item {i} is bad")
    return i


@fleet.workflow(version="1")
def counted_fan(wf: WorkflowContext, n: int, bad: list[int], tolerant: bool = True) -> Any:
    """A map of ``n`` items; every replay of the workflow is logged (step "workflow",
    event "replay"), so a test counts replays as it counts executions."""
    seen = {"run_id": wf.run_id, "step_id": "workflow", "epoch": 0, "attempt": 0}
    append_event("FLEET_TEST_LOG", type("Replay", (), seen), "replay")
    outs = wf.map(tally, [[i, bad] for i in range(n)], return_exceptions=tolerant)
    return [o if not isinstance(o, StepFailed) else f"dead {o.step_id}" for o in outs]


# --- a parent's replay held where a test freezes it (brief S) -------------------------


def hold_replay(wf: WorkflowContext, point: str, hold: list[str]) -> None:
    """``hold`` is ``[where, folder]``. The first replay of the run to reach ``point``
    when it is ``where`` (it creates ``folder/held-<point>`` to say so) logs "held" (step
    "workflow", its pid) and waits, at most 60 s, for the file ``folder/release``, so a
    test can freeze (SIGSTOP) the worker running it mid-replay; it logs "released" as it
    goes on. Every other replay passes at once. It records nothing: the run's steps are
    the same whichever replay is held, or none."""
    where, folder = hold
    if point != where:
        return
    marker = os.path.join(folder, f"held-{point}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    seen = {"run_id": wf.run_id, "step_id": "workflow", "epoch": 0, "attempt": 0}
    replay = type("Replay", (), seen)
    append_event("FLEET_TEST_LOG", replay, "held", point=point)
    release = os.path.join(folder, "release")
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)
    append_event("FLEET_TEST_LOG", replay, "released", point=point)


@fleet.workflow(version="1")
def awaiting_kid(wf: WorkflowContext, i: int, wait: bool) -> int:
    """A child: with ``wait``, it first waits for a "go" signal; then ``work`` on ``i``."""
    if wait:
        wf.wait_for("go")
    return int(wf.step(work, i)["value"])


@fleet.workflow(version="1")
def held_brood(wf: WorkflowContext, n: int, hold: list[str]) -> dict[str, Any]:
    """``n`` children at once (all but the first wait for "go"), then ``other`` over
    their sum. A replay may be held (``hold_replay``) at "start" (no child recorded
    yet), "first" (the first child's result in, the others not), "children" (all theirs
    in, ``other`` not recorded) or "end" (``other`` done too: the run is about to succeed)."""
    hold_replay(wf, "start", hold)
    kids = [wf.start_child(awaiting_kid, i, i > 0, key=f"kid-{i}") for i in range(n)]
    got = [int(kids[0].result())]
    hold_replay(wf, "first", hold)
    got += [int(k.result()) for k in kids[1:]]
    hold_replay(wf, "children", hold)
    after = int(wf.step(other, sum(got)))
    hold_replay(wf, "end", hold)
    return {"children": got, "after": after}


# --- async steps (brief A) ---------------------------------------------------------------
# ``async def`` steps run on the worker process's one event loop. Each logs where it ran
# (``loop``: pid and the loop's id), and "cancelled" when its task is cancelled.


def _where() -> str:
    import asyncio

    return f"{os.getpid()}:{id(asyncio.get_running_loop())}"


@fleet.step(retry=RetryPolicy(max_attempts=5, initial_delay=0.1, max_delay=1.0))
async def anap(ctx: StepContext, i: int, seconds: float = 0.0, hold: float = 0.0) -> dict[str, Any]:
    """``work`` awaited: i², after ``seconds``; the first attempt awaits ``hold`` more
    (to be killed, frozen or cancelled in it)."""
    import asyncio

    await ctx.arecord_usage(model="stand-in", input_tokens=10, output_tokens=i, cost=0.001)
    log_event(ctx, "start", i=i, loop=_where())
    try:
        await asyncio.sleep(seconds + (hold if ctx.attempt == 1 else 0.0))
    except asyncio.CancelledError:
        log_event(ctx, "cancelled", i=i)
        raise
    log_event(ctx, "end", i=i, loop=_where())
    return {"i": i, "value": i * i, "epoch": ctx.epoch, "loop": _where()}


@fleet.workflow(version="1")
def async_chain(wf: WorkflowContext, n: int, hold_at: int = -1, hold: float = 0.0) -> int:
    """A sync ``work`` first, then ``n`` async steps in turn (the ``hold_at``-th holding
    its first attempt ``hold`` seconds), then ``other``: the sum of their squares."""
    wf.step(work, 0)
    total = sum(
        int(wf.step(anap, i, 0.0, hold if i == hold_at else 0.0)["value"]) for i in range(n)
    )
    wf.step(other, total)
    return total


@fleet.workflow(version="1")
def async_pair(wf: WorkflowContext, seconds: float) -> list[str]:
    """Two async steps at once, each awaiting ``seconds``: the loops they ran on."""
    outs = wf.parallel(wf.call(anap, 1, seconds), wf.call(anap, 2, seconds))
    return [str(o["loop"]) for o in outs]


@fleet.step
async def anap_item(ctx: StepContext, item: list[Any]) -> int:
    """``anap`` for ``wf.map``: an item ``[i, seconds]``, awaited."""
    import asyncio

    log_event(ctx, "start", i=item[0])
    await asyncio.sleep(float(item[1]))
    log_event(ctx, "end", i=item[0])
    return int(item[0])


@fleet.step
def where_sync(ctx: StepContext, total: int) -> str:
    """A sync step after async ones: the thread it ran on (never a strand's)."""
    import threading

    name = threading.current_thread().name
    log_event(ctx, "start", thread=name)
    return name


@fleet.workflow(version="1")
def async_crowd(wf: WorkflowContext, n: int, seconds: float) -> dict[str, Any]:
    """``n`` async steps at once, each awaiting ``seconds``, then a sync one and an
    async chain's sync tail: the threads the sync ones ran on."""
    got = wf.map(anap_item, [[i, seconds] for i in range(n)])
    after_map = wf.step(where_sync, sum(got))
    wf.step(anap, 1)  # kept inline by that sync step's commit, then handed to a strand...
    after_chain = wf.step(where_sync, 0)  # ...whose commit sends this sync one to a slot
    return {"sum": sum(got), "threads": [after_map, after_chain]}


@fleet.step(retry=RetryPolicy(max_attempts=5, initial_delay=0.1, max_delay=1.0))
async def aflaky(ctx: StepContext, fails: int) -> int:
    """Asks for a retry (``Retry``) on its first ``fails`` attempts; then its attempt."""
    import asyncio

    log_event(ctx, "start")
    await asyncio.sleep(0.01)
    if ctx.attempt <= fails:
        raise Retry(delay=0.05, reason=f"attempt {ctx.attempt} asks again")
    return ctx.attempt


@fleet.step
async def arefuse(ctx: StepContext, why: str) -> None:
    import asyncio

    log_event(ctx, "start")
    await asyncio.sleep(0.01)
    raise NonRetryable(why)


@fleet.workflow(version="1")
def async_policy(wf: WorkflowContext, fails: int, why: str) -> dict[str, Any]:
    """An async step retried ``fails`` times, then one refused (caught as ``StepFailed``)."""
    took = wf.step(aflaky, fails)
    try:
        wf.step(arefuse, why)
    except StepFailed as exc:
        return {"took": took, "refused": exc.error}
    return {"took": took, "refused": None}


def _lost_its_async(fn: Any) -> Any:
    """A decorator written for sync functions: its wrapper is not ``async def``."""

    def wrapper(ctx: StepContext, *args: Any) -> Any:
        return fn(ctx, *args)

    wrapper.__name__ = fn.__name__
    return wrapper


@fleet.step
@_lost_its_async
async def wrapped_fetch(ctx: StepContext) -> int:
    log_event(ctx, "start")
    return 1


@fleet.workflow(version="1")
def async_wrapped(wf: WorkflowContext) -> int:
    return int(wf.step(wrapped_fetch))


@fleet.workflow(version="1")
def async_frozen(wf: WorkflowContext, first: float, later: float) -> int:
    """``frozen`` with an async step: its first attempt awaits past its lease."""
    wf.step(work, 1)
    held = wf.step(alinger, first, later)
    wf.step(work, 2)
    return int(held["epoch"])


@fleet.step
async def alinger(ctx: StepContext, first: float, later: float) -> dict[str, Any]:
    """Awaits ``first`` seconds on attempt 1 and ``later`` on every other attempt."""
    import asyncio

    log_event(ctx, "start")
    try:
        await asyncio.sleep(first if ctx.attempt == 1 else later)
    except asyncio.CancelledError:
        log_event(ctx, "cancelled")
        raise
    log_event(ctx, "end")
    return {"epoch": ctx.epoch}


async def _asend(ctx: StepContext, body: str, die_after: bool) -> dict[str, Any]:
    import asyncio

    log_event(ctx, "start")
    await asyncio.sleep(0.01)
    receipt = provider_apply(ctx.idempotency_key, body)
    if die_after and ctx.attempt == 1:
        os.kill(os.getpid(), 9)  # the effect reached the provider; the checkpoint did not
    await asyncio.sleep(0.01)
    return receipt


@fleet.step(effect=True, idempotent=True)
async def asend_idempotent(ctx: StepContext, body: str, die_after: bool = False) -> dict[str, Any]:
    return await _asend(ctx, body, die_after)


@fleet.step(effect=True)
async def asend_reconciled(ctx: StepContext, body: str, die_after: bool = False) -> dict[str, Any]:
    return await _asend(ctx, body, die_after)


@asend_reconciled.reconcile
async def asend_reconciled_lookup(ctx: StepContext) -> dict[str, Any] | None:
    import asyncio

    log_event(ctx, "reconcile", loop=_where())
    await asyncio.sleep(0.01)
    return provider_lookup(ctx.idempotency_key)


@fleet.workflow(version="1")
def async_notify(wf: WorkflowContext, how: str, body: str, die_after: bool = False) -> Any:
    sender = {"idempotent": asend_idempotent, "reconciled": asend_reconciled}[how]
    wf.step(work, 1)
    return dict(wf.step(sender, body, die_after))


# --- live runs (fleet/worker/live.py) ---------------------------------------------------

# How many times each run's workflow function was entered in this process: once per
# advance when replayed from the top, once per thread when kept live.
ENTERED: dict[str, int] = {}


def _entered(wf: WorkflowContext) -> None:
    ENTERED[wf.run_id] = ENTERED.get(wf.run_id, 0) + 1


@fleet.workflow(version="1")
def counted(wf: WorkflowContext, n: int) -> int:
    """``n`` sequential steps; counts its entries."""
    _entered(wf)
    return sum(wf.step(nop, i) for i in range(n))


@fleet.workflow(version="1")
def lively(wf: WorkflowContext) -> dict[str, Any]:
    """Every kind of call a workflow makes, in one run: a step, a map, a parallel of a
    step and a child, a recorded value, a transcript, a wait, a started child's result."""
    _entered(wf)
    started = wf.now()
    first = wf.step(nop, 1)
    squares = wf.map(nop, [2, 3, 4])
    both = wf.parallel(wf.call(nop, 5), wf.call(kid, 6))
    chat = wf.transcript()
    chat.append({"role": "user", "content": "hi"})
    chat.append(wf.step(hear, chat))
    later = wf.start_child(kid, 7)
    decision = wf.wait_for("go")
    return {
        "first": first,
        "squares": squares,
        "both": both,
        "heard": len(chat),
        "decision": decision,
        "later": later.result(),
        "random": wf.random() < 1.0,
        "clock": wf.now() >= started,
    }


@fleet.workflow(version="1")
def counted_approval(wf: WorkflowContext) -> Any:
    """work, a wait for approval, work; counts its entries."""
    _entered(wf)
    wf.step(work, 1)
    decision = wf.wait_for("approval")
    wf.step(work, 2)
    return decision


@fleet.workflow(version="1")
def forgiving(wf: WorkflowContext) -> str:
    """Catches a dead step and goes on to a wait."""
    _entered(wf)
    caught = "nothing"
    try:
        wf.step(refuse, "permission denied")
    except StepFailed as exc:
        caught = exc.step_id
    wf.step(nop, 1)
    wf.wait_for("go")
    return f"caught {caught}"


# Called with the run's id whenever ``drawn`` runs past a draw (in the advance that
# records it, or replays it): a test's probe of where an advance stands.
ON_DRAW: list[Callable[[str], None]] = []


@fleet.workflow(version="1")
def drawn(wf: WorkflowContext, n: int, wait: bool = False) -> list[Any]:
    """``n`` rounds of a recorded draw (``wf.random``) and a step, each draw recorded
    in the advance that records the round's step; with ``wait``, a wait for "go" after
    the first round. It returns every draw: a workflow resumed past a draw whose record
    rolled back (or another run's) returns what no replay of the history returns.
    Counts its entries."""
    _entered(wf)
    out: list[Any] = []
    for i in range(n):
        draw = wf.random()
        for probe in ON_DRAW:
            probe(wf.run_id)
        out.append([wf.step(nop, i), draw])
        if wait and i == 0:
            out.append(wf.wait_for("go"))
    return out


# --- async steps that misbehave (issue 48, item 11) -----------------------------------


@fleet.step
async def ablock(ctx: StepContext, seconds: float) -> str:
    """Blocks the loop ``seconds`` (time.sleep, not an await)."""
    log_event(ctx, "start")
    time.sleep(seconds)
    return ctx.step_id


@fleet.workflow(version="1")
def async_blocking(wf: WorkflowContext, seconds: float) -> str:
    return str(wf.step(ablock, seconds))


@fleet.step
async def aswallow(ctx: StepContext) -> None:
    """Awaits forever and swallows every CancelledError it is sent."""
    import asyncio

    log_event(ctx, "start")
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            log_event(ctx, "swallowed")


@fleet.workflow(version="1")
def async_swallowing(wf: WorkflowContext) -> None:
    wf.step(aswallow)
