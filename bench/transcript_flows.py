"""Workflows for the transcript benchmark (issue #15): three agent loops of model turns
that differ only in what each turn is given, and a probe of a step's window reads.

Run in process by ``bench/transcripts.py`` (``fleet.testing.InlineBroker`` on a SQLite
file); workers could load it too (``-A bench.transcript_flows``). Each model turn returns
a deterministic ~2 KB assistant message (``reply``), so every loop records the same
messages and only how they reach the step differs.
"""

from __future__ import annotations

import time
from typing import Any

from fleet import Fleet, StepContext, WorkflowContext

fleet = Fleet("benchchat")
celery_app = fleet.celery

REPLY_CHARS = 2000
_TEXT = (
    "durable execution replays the workflow from the top and every step already done "
    "returns its recorded output so the model turn is paid once while the transcript "
    "grows by one reply per turn and is stored once"
)
_WORDS = _TEXT.split()


def reply(turn: int) -> dict[str, Any]:
    """Turn ``turn``'s assistant message: ~2 KB of deterministic text."""
    words = [f"turn {turn}:"]
    k, size = turn, len(words[0])
    while size < REPLY_CHARS:
        word = _WORDS[k % len(_WORDS)]
        words.append(word)
        size += len(word) + 1
        k = (k * 7 + 3) % 1_000_003
    return {"role": "assistant", "content": " ".join(words)[:REPLY_CHARS]}


def user(turn: int) -> dict[str, Any]:
    """The short user message that follows turn ``turn``."""
    return {"role": "user", "content": f"go on after turn {turn}"}


FIRST = {"role": "user", "content": "write the long report, one section per turn"}

# What the step bodies measured, read by the benchmark in the same process: seconds
# spent reading what each turn was given, and the probe's statement counts.
BODY_READ_SECONDS: list[float] = []
BODY_READ_CPU: list[float] = []  # the same reads in this thread's CPU seconds
COUNTING = False  # the benchmark's statement listener counts only while this is set
PROBES: list[dict[str, Any]] = []
STATEMENTS = [0, 0]  # every statement, and the SELECTs among them
CACHE: Any = None  # the bound fleet's MessageCache, set by the benchmark


@fleet.step
def model_turn(ctx: StepContext, messages: Any, turn: int) -> dict[str, Any]:
    """A stand-in for a model call: reads every message it is given (a model is sent
    them all), then answers with ``reply(turn)``."""
    t0, c0 = time.perf_counter(), time.thread_time()
    seen = len(list(messages)) if messages is not None else 0
    BODY_READ_SECONDS.append(time.perf_counter() - t0)
    BODY_READ_CPU.append(time.thread_time() - c0)
    out = reply(turn)
    out["content"] = f"(saw {seen}) " + out["content"]
    return out


@fleet.workflow(version="1")
def quadratic(wf: WorkflowContext, turns: int) -> int:
    """Today's natural loop: the growing ``messages`` list is each step's input."""
    messages: list[dict[str, Any]] = [FIRST]
    for turn in range(1, turns + 1):
        messages.append(wf.step(model_turn, messages, turn))
        messages.append(user(turn))
    return len(messages)


@fleet.workflow(version="1")
def transcript(wf: WorkflowContext, turns: int) -> int:
    """The same loop on a transcript: each step is given a cursor over the window."""
    chat = wf.transcript()
    chat.append(FIRST)
    for turn in range(1, turns + 1):
        chat.append(wf.step(model_turn, chat.window(), turn))
        chat.append(user(turn))
    return len(chat)


@fleet.workflow(version="1")
def nothing(wf: WorkflowContext, turns: int) -> int:
    """The same steps, given nothing and appending nowhere: the floor."""
    for turn in range(1, turns + 1):
        wf.step(model_turn, None, turn)
    return turns


@fleet.step
def probe(ctx: StepContext, chat: Any, label: str) -> int:
    """Reads the whole window it is given, counting the statements that takes."""
    global COUNTING
    before, selects = STATEMENTS[0], STATEMENTS[1]
    reads = CACHE.reads if CACHE is not None else 0
    COUNTING = True
    try:
        seen = len(list(chat))
    finally:
        COUNTING = False
    PROBES.append(
        {
            "step": label,
            "messages": seen,
            "statements": STATEMENTS[0] - before,
            "selects": STATEMENTS[1] - selects,
            "cache_reads": (CACHE.reads if CACHE is not None else 0) - reads,
        }
    )
    return seen


@fleet.workflow(version="1")
def window_reads(wf: WorkflowContext, size: int, more: int) -> list[int]:
    """A ``size``-message window read by a step; then ``more`` messages and a step over
    the grown window; then a step over that same window again."""
    chat = wf.transcript()
    for i in range(size):
        chat.append(reply(i) if i % 2 else user(i))
    first = wf.step(probe, chat.window(), "first", key="first")
    for i in range(size, size + more):
        chat.append(user(i))
    grown = wf.step(probe, chat.window(), "grown", key="grown")
    again = wf.step(probe, chat.window(), "again", key="again")
    return [first, grown, again]
