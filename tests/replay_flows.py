"""Workflows recorded in a test's process and replayed locally (``fleet.testing.replay``,
tests/integration/test_local_replay.py, tests/integration/test_history_export.py,
tests/e2e/test_cli_replay.py). Every step body counts itself in ``BODIES``: a replay
must leave it as it was.

Loaded with ``REPLAY_FLOWS_CHANGE`` set to a key of ``CHANGED`` (a ``fleet replay``
subprocess), the module registers that changed ``agent``: the code as edited after its
runs were recorded."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from fleet import Fleet, Secret, StepContext, WorkflowContext
from fleet.registry import WorkflowDef

fleet = Fleet("replayflows")
BODIES: Counter[str] = Counter()  # step bodies executed in this process, by step name


@fleet.step
def think(ctx: StepContext, chat: Any) -> dict[str, Any]:
    BODIES["think"] += 1
    return {"role": "assistant", "content": f"about {chat[-1]['content']}"}


@fleet.step
def add(ctx: StepContext, a: int, b: int) -> int:
    BODIES["add"] += 1
    return a + b


@fleet.step
def double(ctx: StepContext, x: int) -> int:
    BODIES["double"] += 1
    return 2 * x


@fleet.step
def summarize(ctx: StepContext, messages: Any) -> str:
    BODIES["summarize"] += 1
    return "so far: " + " / ".join(str(m["content"]) for m in messages)


KEY = "REPLAY_FLOWS_KEY"  # the environment variable a secret is read from
LARGE = 300 * 1024  # over the default FLEET_MAX_PAYLOAD_BYTES: stored by reference


@fleet.step
def sign(ctx: StepContext, key: Secret, text: str) -> dict[str, Any]:
    """Uses a secret (given by name) and returns a value too large to record inline."""
    BODIES["sign"] += 1
    return {"signed": f"{text} ({len(key.reveal())}-character key)", "padding": "x" * LARGE}


@fleet.workflow(version="1")
def keyed(wf: WorkflowContext, text: str) -> dict[str, Any]:
    """A step given a secret by name, whose output is stored by reference."""
    out = wf.step(sign, Secret.env(KEY), text)
    return {"signed": out["signed"], "padding": len(out["padding"])}


@fleet.workflow(version="1")
def helper(wf: WorkflowContext, n: int) -> int:
    return int(wf.step(add, n, 1))


@fleet.workflow(version="1")
def agent(wf: WorkflowContext, topic: str, strict: bool = False) -> dict[str, Any]:
    """A transcript and a step given it, a recorded random value, a fan-out, a child run,
    a wait for approval (rejected and ``strict``: the run fails), a step, a compaction."""
    chat = wf.transcript()
    chat.append({"role": "user", "content": topic})
    reply = wf.step(think, chat)
    chat.append(reply)
    luck = wf.random()
    doubled = wf.map(double, [1, 2, 3])
    child = wf.child(helper, 41, key="helper")
    decision = wf.wait_for("approval")
    if strict and not decision.get("approved"):
        raise RuntimeError(f"rejected by {decision.get('by')}")
    total = wf.step(add, child, sum(doubled))
    wf.compact(chat, summarize, keep_last=1)
    return {
        "reply": reply["content"],
        "luck": luck,
        "doubled": doubled,
        "child": child,
        "decision": decision,
        "total": total,
        "window": list(chat.window()),
    }


# --- the same workflow, changed after its runs were recorded ------------------------------


def _asks_first(wf: WorkflowContext, topic: str, strict: bool = False) -> Any:
    """Adds a step before the first one."""
    wf.step(add, 0, 0)
    return agent.fn(wf, topic, strict)


def _says_otherwise(wf: WorkflowContext, topic: str, strict: bool = False) -> Any:
    """Appends another first message to the transcript."""
    return agent.fn(wf, topic.upper(), strict)


def _one_more(wf: WorkflowContext, topic: str, strict: bool = False) -> Any:
    """Ends with one more step."""
    out = agent.fn(wf, topic, strict)
    wf.step(add, 1, 1)
    return out


CHANGED = {
    "asks_first": WorkflowDef("agent", _asks_first, "1"),
    "says_otherwise": WorkflowDef("agent", _says_otherwise, "1"),
    "one_more": WorkflowDef("agent", _one_more, "1"),
}

_change = os.environ.get("REPLAY_FLOWS_CHANGE")
if _change:
    fleet.registry.workflows["agent"] = CHANGED[_change]
