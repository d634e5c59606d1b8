"""Transcript workflows the tests run on real workers (``-A tests.chat_flows``). Each
model-like step call is appended to FLEET_TEST_LOG, outside the store, so tests can
count calls."""

from __future__ import annotations

import json
import os
from typing import Any

from fleet import Fleet, StepContext, WorkflowContext
from tests.provider import append_event

fleet = Fleet("testchat")
celery_app = fleet.celery
MODEL = "stand-in-chat-1"


@fleet.step
def respond(ctx: StepContext, chat: Any, turn: int = 1) -> dict[str, Any]:
    """An assistant turn over the window it is given: names what it saw; every second
    turn also asks for a tool."""
    window = list(chat)
    append_event("FLEET_TEST_LOG", ctx, "respond", seen=len(window))
    reply: dict[str, Any] = {
        "role": "assistant",
        "content": f"turn {turn}: I saw {len(window)} messages, the last from "
        f"{window[-1].get('role') if window else 'nobody'}",
    }
    if turn % 2 == 0:
        reply["tool_calls"] = [{"id": f"call-{turn}", "name": "lookup", "args": {"q": turn}}]
    return reply


@fleet.step
def lookup(ctx: StepContext, args: dict[str, Any]) -> str:
    return json.dumps({"answer": args["q"] * 7})


@fleet.step
def summarize(ctx: StepContext, messages: Any) -> str:
    """Keeps every line: a faithful (if long) summary."""
    return "summary: " + " / ".join(str(m.get("content")) for m in messages)


@fleet.step
def lossy_summary(ctx: StepContext, messages: Any) -> str:
    """Drops whatever mentions the vault: a compaction that loses a fact."""
    kept = [str(m.get("content")) for m in messages if "vault" not in str(m.get("content"))]
    return "summary: " + " / ".join(kept)


@fleet.workflow(version="1", pins={"model": MODEL})
def chatty(wf: WorkflowContext, turns: int, compact_every: int = 0) -> int:
    chat = wf.transcript("main")
    chat.append({"role": "user", "content": "start"})
    for turn in range(1, turns + 1):
        reply = wf.step(respond, chat.window(), turn)
        chat.append(reply)
        for call in reply.get("tool_calls") or []:
            result = wf.step(lookup, call["args"], key=call["id"])
            chat.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        chat.append({"role": "user", "content": f"go on after turn {turn}"})
        if compact_every and turn % compact_every == 0:
            wf.compact(chat, summarize, keep_last=2)
    return len(chat)


@fleet.workflow(version="1")
def long_chat(wf: WorkflowContext, n: int, compact_at: list[int]) -> int:
    """``n`` short messages, compacted (keeping the last two) once the transcript holds
    each length in ``compact_at``: a transcript longer than a page of ``fleet transcript``."""
    chat = wf.transcript("main")
    for i in range(n):
        chat.append({"role": "assistant" if i % 2 else "user", "content": f"message {i}"})
        if len(chat) in compact_at:
            wf.compact(chat, summarize, keep_last=2)
    return len(chat)


@fleet.workflow(version="1")
def drifting(wf: WorkflowContext) -> int:
    """What it appends second depends on the worker's code (CHAT_VARIANT)."""
    chat = wf.transcript("main")
    chat.append({"role": "user", "content": "hello"})
    chat.append({"role": "assistant", "content": f"variant {os.environ.get('CHAT_VARIANT', 'a')}"})
    wf.step(respond, chat)
    wf.wait_for("go")
    chat.append({"role": "user", "content": "after the wait"})
    return len(chat)


@fleet.workflow(version="1")
def forgetful(wf: WorkflowContext) -> list[Any]:
    """A compaction that drops a fact, then, once told, one over raw that keeps it."""
    chat = wf.transcript("main")
    for line in ("the sky is blue", "the vault code is 4471", "lunch is at noon", "ok"):
        chat.append({"role": "user", "content": line})
    first = wf.compact(chat, lossy_summary, keep_last=1)
    wf.wait_for("redo")
    second = wf.compact(chat, summarize, keep_last=1, raw=True)
    return [first, second, len(chat.window())]
