"""A tool-using agent on fleet: the notes agent.

The model (the stand-in of ``tasks/model.py`` unless ``FLEET_MODEL`` names another)
is asked for the next move each turn, with the transcript's window as its input, and
answers with tool calls: ``list_notes`` and ``read_note`` are plain steps (reads, run
again freely), ``write_note`` is an effect keyed by its tool call, and
``delete_note`` is destructive, so the run waits for a person's ``approval`` signal
before it. ``research`` hands a sub-task to a subagent: a child run of the research
workflow (``tasks/research.py``), with its own steps, retries and spend, which rolls
up into the agent's. The safe tool calls of a turn run at once (``wf.parallel``).
Every ``compact_every`` turns the older messages are summarized; the raw transcript
keeps everything, the model is shown the summary and the last few.

The notes read are a fixed set (``NOTES``); what the agent writes or deletes goes to
a log file (``FLEET_NOTES_LOG``, default ``.fleet/notes.jsonl``), once per
idempotency key. ``FLEET_TOOL_LATENCY`` (seconds) makes every tool slow on purpose.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from fleet import RetryPolicy, StepContext, WorkflowContext
from tasks.app import MODEL_LIMITS, call_tokens, fleet
from tasks.model import DEFAULT_MODEL, get_model
from tasks.research import research

TASK = "Tidy my notes: read them all, write a digest, and delete the scratch note."
SYSTEM = "You are a careful assistant with tools over the user's notes. Use one tool at a time."
MAX_TURNS = 20
KEEP_LAST = 4
STEP_RETRY = RetryPolicy(max_attempts=5, initial_delay=0.5, backoff=2.0, max_delay=10.0)
DEFAULT_NOTES_LOG = ".fleet/notes.jsonl"
NOTES: dict[str, str] = {
    "groceries": "Oat milk, lemons and coffee beans before Friday. The shop on Elm Street "
    "closes at eight.",
    "ideas": "A durable agent should never ask the model the same question twice. Keep the "
    "transcript, not a copy of it.",
    "meeting-2026-11-02": "Agreed to ship the transcript view first. Compaction follows "
    "once the window is measured.",
    "reading-list": "Designing Data-Intensive Applications, chapter 9. The Temporal paper on "
    "replay.",
    "scratch": "asdf asdf. Temporary buffer from a call; nothing to keep.",
    "trip": "Train to Lyon on the 14th, back on the 17th. Book the hotel near the station.",
}


def _tool(tool: str, description: str, /, **params: str) -> dict[str, Any]:
    props = {p: {"type": "string", "description": d} for p, d in params.items()}
    schema = {"type": "object", "properties": props, "required": list(params)}
    return {
        "type": "function",
        "function": {"name": tool, "description": description, "parameters": schema},
    }


TOOL_SPECS: list[dict[str, Any]] = [
    _tool("list_notes", "The names of every note."),
    _tool("read_note", "One note's text.", name="the note's name"),
    _tool("write_note", "Create or replace a note.", name="its name", text="its text"),
    _tool("delete_note", "Delete a note (asks a person first).", name="the note's name"),
    _tool("research", "Have a researcher (a subagent) report on a topic.", topic="the topic"),
]
DESTRUCTIVE = frozenset({"delete_note"})


def notes_log() -> Path:
    """The file named by ``FLEET_NOTES_LOG``."""
    return Path(os.environ.get("FLEET_NOTES_LOG") or DEFAULT_NOTES_LOG)


def read_notes_log(path: Path | None = None) -> list[dict[str, Any]]:
    """Every write and delete applied so far, oldest first."""
    path = path or notes_log()
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _apply(key: str, change: dict[str, Any]) -> bool:
    """Append ``change`` unless ``key`` was applied already; True if it was. An
    exclusive lock makes check-and-append one step (a zombie and its successor)."""
    path = notes_log()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        if any(line.strip() and json.loads(line).get("key") == key for line in f):
            return False
        f.write(json.dumps({"key": key, **change}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def _pause() -> None:
    seconds = float(os.environ.get("FLEET_TOOL_LATENCY", "").strip() or 0)
    if seconds > 0:
        time.sleep(seconds)


# --- the tools: what they return is the tool message's content (JSON text) -------------


@fleet.step(retry=STEP_RETRY)
def list_notes(ctx: StepContext) -> str:
    _pause()
    return json.dumps({"notes": sorted(NOTES)})


@fleet.step(retry=STEP_RETRY)
def read_note(ctx: StepContext, name: str) -> str:
    _pause()
    if name not in NOTES:
        return json.dumps({"error": f"no note named {name!r}"})
    return json.dumps({"name": name, "text": NOTES[name]})


@fleet.step(effect=True, idempotent=True)
def write_note(ctx: StepContext, name: str, text: str) -> str:
    _pause()
    _apply(ctx.idempotency_key, {"op": "write", "name": name, "text": text})
    return json.dumps({"written": name, "bytes": len(text.encode())})


@fleet.step(effect=True, idempotent=True)
def delete_note(ctx: StepContext, name: str) -> str:
    _pause()
    _apply(ctx.idempotency_key, {"op": "delete", "name": name})
    return json.dumps({"deleted": name})


# A tool is a step, or a workflow run as a child run of the agent (a subagent).
TOOLS = {f.name: f for f in (list_notes, read_note, write_note, delete_note, research)}


# --- the model's steps ------------------------------------------------------------------


@fleet.step(retry=STEP_RETRY, limits=MODEL_LIMITS, tokens=call_tokens)
def model_turn(ctx: StepContext, chat: Any, turn: int) -> dict[str, Any]:
    """Ask the run's pinned model for the next message, shown ``chat`` (a window)."""
    tag = {"run": ctx.run_id, "turn": turn, "attempt": ctx.attempt}
    reply = get_model().chat(list(chat), TOOL_SPECS, model=ctx.pins["model"], tag=tag)
    ctx.record_usage(**reply.usage)
    assert reply.data is not None
    return reply.data


@fleet.step(retry=STEP_RETRY, limits=MODEL_LIMITS, tokens=call_tokens)
def summarize(ctx: StepContext, messages: Any) -> list[dict[str, Any]]:
    """The head of the new window: the system prompt, then a summary of ``messages``."""
    seen = list(messages)
    tag = {"run": ctx.run_id, "step": ctx.step_id, "attempt": ctx.attempt}
    summary = get_model().summarize_chat(seen, tag=tag)
    ctx.record_usage(**summary.usage)
    system = [m for m in seen[:1] if m == {"role": "system", "content": SYSTEM}]
    return [*system, {"role": "system", "content": summary.text}]


# --- the agent ----------------------------------------------------------------------------


def run_tools(wf: WorkflowContext, calls: list[dict[str, Any]]) -> list[str]:
    """A turn's tool calls, results in the calls' order, each a step keyed by its call
    id. The safe ones run at once (``wf.parallel``: a model that asks for three reads
    waits for the slowest, not for their sum; a ``research`` call is a child run among
    them); a destructive one waits for a person's approval first, then runs on its own."""
    parsed = [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]
    safe = [(i, name, args) for i, name, args in parsed if name not in DESTRUCTIVE]
    results = dict(
        zip(
            [i for i, _, _ in safe],
            wf.parallel(*[wf.call(TOOLS[name], **args, key=i) for i, name, args in safe]),
            strict=True,
        )
    )
    for call_id, name, args in parsed:
        if name in DESTRUCTIVE:
            ok = wf.wait_for("approval", timeout=timedelta(days=3))
            if ok and ok.get("approved"):
                results[call_id] = wf.step(TOOLS[name], **args, key=call_id)
            else:
                results[call_id] = json.dumps(
                    {"refused": args.get("name"), "by": (ok or {}).get("by")}
                )
    return [_content(results[call_id]) for call_id, _, _ in parsed]


def _content(result: Any) -> str:
    """A tool message's content: a step's text as it is, a subagent's result as JSON."""
    return result if isinstance(result, str) else json.dumps(result, sort_keys=True)


@fleet.workflow(version="1", pins={"model": DEFAULT_MODEL})
def agent(wf: WorkflowContext, task: str = TASK, compact_every: int = 3) -> dict[str, Any]:
    """Ask the model, run the tools it calls, repeat until it answers without any."""
    if compact_every < 1:
        raise ValueError(f"compact_every must be 1 or more, got {compact_every}")
    chat = wf.transcript("main")
    chat.append({"role": "system", "content": SYSTEM})
    chat.append({"role": "user", "content": task})
    for turn in range(1, MAX_TURNS + 1):
        reply = wf.step(model_turn, chat.window(), turn)
        chat.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls:
            return {"answer": reply["content"], "turns": turn, "messages": len(chat)}
        for call, result in zip(calls, run_tools(wf, calls), strict=True):
            name = call["function"]["name"]
            chat.append(
                {"role": "tool", "tool_call_id": call["id"], "name": name, "content": result}
            )
        if turn % compact_every == 0:
            wf.compact(chat, summarize, keep_last=KEEP_LAST)
    raise RuntimeError(f"the agent did not finish in {MAX_TURNS} turns")
