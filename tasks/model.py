"""An offline, deterministic stand-in for a language model, and the hook for a real one.

Same input, same output and same usage: no network, no randomness, no clock. Tokens
are whitespace-separated words. ``FLEET_MODEL_LATENCY`` (seconds) makes each call
slow on purpose; ``FLEET_MODEL="module:attr"`` plugs in another model object.

``chat`` is the tool-using side (the notes agent, ``tasks/agent.py``): it reads what
the conversation has done so far from the messages it is shown (tool results, or a
summary that replaced them) and asks for the next tool calls, OpenAI style. With
``FLEET_MODEL_CALLS=<path>`` every ``chat`` and ``summarize_chat`` call appends one
JSON line to that file (O_APPEND, so processes share it): who asked, for which turn.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from tasks.text import sentences, terms, word_count

DEFAULT_MODEL = "example-model-2026-10"
INPUT_PRICE = 0.000002  # per input token
OUTPUT_PRICE = 0.000008  # per output token
PLAN_TEMPLATES: tuple[str, ...] = (
    "What is {topic}?",
    "How does {topic} handle failures?",
    "What does {topic} cost?",
    "Who uses {topic}?",
)


@dataclass(frozen=True)
class Completion:
    """A model's answer with what it cost. ``data`` holds structured output (a plan)."""

    model: str
    text: str
    input_tokens: int
    output_tokens: int
    cost: float
    data: dict[str, Any] | None = None

    @property
    def usage(self) -> dict[str, Any]:
        """Keyword arguments for ``ctx.record_usage``."""
        return {
            "model": self.model,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost": self.cost,
        }


class Model(Protocol):
    """What the research steps need from a model, stand-in or real."""

    name: str

    def plan(self, topic: str) -> Completion: ...
    def answer(self, question: str, passages: list[str]) -> Completion: ...
    def synthesize(self, topic: str, answers: list[str]) -> Completion: ...
    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        model: str | None = None,
        tag: dict[str, Any] | None = None,
    ) -> Completion: ...
    def summarize_chat(
        self, messages: list[dict[str, Any]], *, tag: dict[str, Any] | None = None
    ) -> Completion: ...


class StandInModel:
    """A deterministic model built from templates and the passages it is given."""

    def __init__(self, name: str = DEFAULT_MODEL) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StandInModel({self.name!r})"

    def plan(self, topic: str) -> Completion:
        """Four sub-questions about ``topic``; ``data`` is ``{"subquestions": [...]}``."""
        topic = _clean(topic)
        prompt = f"Plan research on the topic: {topic}. List four sub-questions, one a line."
        questions = [t.format(topic=topic) for t in PLAN_TEMPLATES]
        return self._complete(prompt, "\n".join(questions), data={"subquestions": questions})

    def answer(self, question: str, passages: list[str]) -> Completion:
        """A short answer: the two passage sentences sharing most words with ``question``."""
        question = _clean(question)
        prompt = f"Answer from the passages only.\nQuestion: {question}\nPassages:\n" + "\n".join(
            passages
        )
        best = _best_sentences(question, passages, n=2)
        text = " ".join(best) if best else f"The sources do not answer: {question}"
        return self._complete(prompt, text)

    def synthesize(self, topic: str, answers: list[str]) -> Completion:
        """A short report: one line per answer, then the sentence closest to ``topic``."""
        topic = _clean(topic)
        prompt = f"Write a short report on {topic} from these findings:\n" + "\n".join(answers)
        lines = [f"Report: {topic}"]
        lines += [f"{i}. {_first_sentence(a)}" for i, a in enumerate(answers, start=1)]
        best = _best_sentences(topic, answers, n=1)
        if best:
            lines.append(f"In short: {best[0]}")
        return self._complete(prompt, "\n".join(lines))

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        model: str | None = None,
        tag: dict[str, Any] | None = None,
    ) -> Completion:
        """The next assistant message of the notes task (``data``; ``text`` is its
        content): tool calls while work is left, then a final answer without any.
        ``model`` names the model asked (the run's pin); ``tag`` goes to the call log."""
        log_call("chat", tag)
        offered = {str(t.get("function", {}).get("name")) for t in tools}
        message = next_message(read_progress(messages), offered)
        prompt = "\n".join(_message_text(m) for m in messages)
        completion = self._complete(prompt, _message_text(message), data=message)
        return replace(completion, model=model or self.name)

    def summarize_chat(
        self, messages: list[dict[str, Any]], *, tag: dict[str, Any] | None = None
    ) -> Completion:
        """What ``messages`` did, as the fact lines ``chat`` reads back: a summary that
        can stand in for them."""
        log_call("summarize", tag)
        progress = read_progress(messages)
        text = "\n".join([SUMMARY_HEAD, *progress.facts()])
        return self._complete("\n".join(_message_text(m) for m in messages), text)

    def _complete(self, prompt: str, text: str, data: dict[str, Any] | None = None) -> Completion:
        _pause()
        inp, out = word_count(prompt), word_count(text)
        cost = round(inp * INPUT_PRICE + out * OUTPUT_PRICE, 10)
        return Completion(self.name, text, inp, out, cost, data)


# --- the notes task, as the stand-in plays it ------------------------------------------

SUMMARY_HEAD = "Summary of the conversation so far:"
READS_PER_TURN = 2
DIGEST = "digest"
CALLS_ENV = "FLEET_MODEL_CALLS"
# "…, research durable execution, …": a topic the task hands to the research subagent.
RESEARCH_ASK = re.compile(r"\bresearch\s+([^.,;:!?]+)", re.IGNORECASE)


@dataclass
class Progress:
    """What the notes task has done, as read from the messages a model is shown."""

    task: str = ""
    notes: list[str] | None = None
    read: dict[str, str] = field(default_factory=dict)  # note -> its first sentence
    written: str | None = None
    deleted: tuple[str, str] | None = None  # (note, "deleted" | "refused")
    researched: dict[str, str] = field(default_factory=dict)  # topic -> its report's gist

    @property
    def topic(self) -> str | None:
        """What the task asks to have researched (by a subagent), if anything."""
        found = RESEARCH_ASK.search(self.task)
        return " ".join(found.group(1).split()) if found else None

    def facts(self) -> list[str]:
        """One line per fact, in the form ``read_progress`` parses back."""
        lines = [f"- task: {_one_line(self.task)}"] if self.task else []
        if self.notes is not None:
            lines.append(f"- notes: {', '.join(self.notes)}")
        lines += [f"- read {name}: {gist}" for name, gist in self.read.items()]
        lines += [f"- researched {topic}: {gist}" for topic, gist in self.researched.items()]
        if self.written:
            lines.append(f"- wrote {self.written}")
        if self.deleted:
            lines.append(f"- delete {self.deleted[0]}: {self.deleted[1]}")
        return lines


def read_progress(messages: list[dict[str, Any]]) -> Progress:
    """The task's progress from a window: a summary's fact lines, the user's request
    and the tool results (each names its tool, so a result needs no earlier call)."""
    p = Progress()
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str):
            continue
        if role == "system" and content.startswith(SUMMARY_HEAD):
            _read_facts(p, content.splitlines()[1:])
        elif role == "user" and not p.task:
            p.task = content
        elif role == "tool":
            _read_result(p, str(m.get("name", "")), content)
    return p


def _read_facts(p: Progress, lines: list[str]) -> None:
    for line in lines:
        head, _, rest = line.removeprefix("- ").partition(": ")
        if head == "task":
            p.task = rest
        elif head == "notes":
            p.notes = [n for n in rest.split(", ") if n]
        elif head.startswith("read "):
            p.read[head.removeprefix("read ")] = rest
        elif head.startswith("researched "):
            p.researched[head.removeprefix("researched ")] = rest
        elif head.startswith("wrote "):
            p.written = head.removeprefix("wrote ")
        elif head.startswith("delete "):
            p.deleted = (head.removeprefix("delete "), rest)


def _read_result(p: Progress, tool: str, content: str) -> None:
    try:
        data = json.loads(content)
    except ValueError:
        return
    if not isinstance(data, dict):
        return
    if tool == "list_notes" and isinstance(data.get("notes"), list):
        p.notes = [str(n) for n in data["notes"]]
    elif tool == "read_note" and "text" in data:
        p.read[str(data["name"])] = gist(str(data["text"]))
    elif tool == "research" and "report" in data:
        p.researched[str(data.get("topic"))] = report_gist(str(data["report"]))
    elif tool == "write_note" and "written" in data:
        p.written = str(data["written"])
    elif tool == "delete_note":
        if "deleted" in data:
            p.deleted = (str(data["deleted"]), "deleted")
        elif "refused" in data:
            p.deleted = (str(data["refused"]), "refused")


def next_message(p: Progress, offered: set[str]) -> dict[str, Any]:
    """The assistant's next message: the next tool calls of the plan (list, read two
    at a time, write the digest, delete the scratch notes), or the final answer. A task
    that asks to research a topic has it researched beside the listing, by the
    ``research`` tool (a subagent) when it is offered."""
    notes = p.notes or []
    unread = [n for n in notes if n not in p.read]
    scratch = [n for n in notes if n.startswith("scratch")]
    if p.notes is None:
        why = f"To do this ({_one_line(p.task)}) I first list the notes."
        calls: list[tuple[str, dict[str, Any]]] = [("list_notes", {})]
        topic = p.topic
        if topic and topic not in p.researched and "research" in offered:
            why += f" Meanwhile a researcher looks into {topic}."
            calls.append(("research", {"topic": topic}))
    elif unread:
        batch = unread[:READS_PER_TURN]
        why = (
            f"There are {len(notes)} notes ({', '.join(notes)}); {len(p.read)} read so far. "
            f"Next I read {' and '.join(batch)}."
        )
        calls = [("read_note", {"name": n}) for n in batch]
    elif p.written is None:
        why = f"I have read all {len(notes)} notes; I write their digest to {DIGEST!r}."
        calls = [("write_note", {"name": DIGEST, "text": digest(p.read, p.researched)})]
    elif scratch and p.deleted is None:
        why = f"The digest is written. {scratch[0]!r} holds nothing worth keeping: I delete it."
        calls = [("delete_note", {"name": scratch[0]})]
    else:
        return {"role": "assistant", "content": final_answer(p)}
    missing = [name for name, _ in calls if name not in offered]
    if missing:
        return {"role": "assistant", "content": f"I cannot go on: no tool {missing[0]!r}."}
    return {
        "role": "assistant",
        "content": why,
        "tool_calls": [
            {
                "id": "_".join(["call", name, *([str(args["name"])] if "name" in args else [])]),
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, sort_keys=True)},
            }
            for name, args in calls
        ],
    }


def digest(read: dict[str, str], researched: dict[str, str] | None = None) -> str:
    """The digest note: one line per note read, its first sentence; then one line per
    topic researched, its report's gist."""
    lines = [f"Digest of {len(read)} notes"]
    lines += [f"- {name}: {g}" for name, g in sorted(read.items())]
    lines += [f"- research on {t}: {g}" for t, g in sorted((researched or {}).items())]
    return "\n".join(lines)


def final_answer(p: Progress) -> str:
    """What was done, in one sentence."""
    text = f"Done: I read {len(p.read)} notes ({', '.join(p.read)})"
    if p.researched:
        text += f"; a researcher looked into {', '.join(p.researched)}"
    if p.written:
        text += f"; I wrote their digest to {p.written!r}"
    if p.deleted:
        note, outcome = p.deleted
        text += (
            f"; I deleted {note!r}"
            if outcome == "deleted"
            else f"; I kept {note!r}: deleting it was refused"
        )
    return text + "."


def gist(text: str) -> str:
    """A note's first sentence, on one line, at most 120 characters."""
    first = _first_sentence(text) or text
    return _one_line(first)[:120]


def report_gist(report: str) -> str:
    """A research report's gist: its "In short:" sentence, else its first line."""
    lines = [line for line in report.splitlines() if line.strip()]
    short = [line.removeprefix("In short:") for line in lines if line.startswith("In short:")]
    return _one_line((short or lines or [""])[0])[:120]


def log_call(kind: str, tag: dict[str, Any] | None) -> None:
    """Append ``{"kind", "pid", **tag}`` to ``FLEET_MODEL_CALLS`` when it is set."""
    path = os.environ.get(CALLS_ENV, "").strip()
    if not path:
        return
    line = json.dumps({"kind": kind, "pid": os.getpid(), **(tag or {})}, sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of one short line: appends do not interleave
    finally:
        os.close(fd)


def read_calls(path: Path | str) -> list[dict[str, Any]]:
    """Every call logged to ``path`` (a ``FLEET_MODEL_CALLS`` file), oldest first."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _message_text(m: dict[str, Any]) -> str:
    calls = m.get("tool_calls") or []
    args = [f"{c['function']['name']}({c['function']['arguments']})" for c in calls]
    return " ".join([str(m.get("content") or ""), *args])


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def get_model() -> Model:
    """The stand-in, unless ``FLEET_MODEL="module:attr"`` names another model (an object,
    or a class to instantiate with no arguments) with the same methods."""
    spec = os.environ.get("FLEET_MODEL", "").strip()
    if not spec:
        return StandInModel()
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"FLEET_MODEL={spec!r} must be 'module:attr'")
    obj = getattr(importlib.import_module(module_name), attr)
    model: Model = obj() if isinstance(obj, type) else obj
    return model


def _pause() -> None:
    raw = os.environ.get("FLEET_MODEL_LATENCY", "").strip()
    if not raw:
        return
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"FLEET_MODEL_LATENCY={raw!r} is not a number of seconds") from None
    if seconds > 0:
        time.sleep(seconds)


def _clean(text: str) -> str:
    return " ".join(str(text).split()).rstrip("?.! ") or "(empty)"


def _first_sentence(text: str) -> str:
    found = sentences(text)
    return found[0] if found else ""


def _best_sentences(query: str, texts: list[str], n: int) -> list[str]:
    """Up to ``n`` sentences of ``texts`` sharing most words with ``query``, in the order
    they appear; sentences sharing none are left out. Ties go to the earlier sentence."""
    wanted = set(terms(query))
    pool = list(dict.fromkeys(s for t in texts for s in sentences(t)))
    scored = [(len(wanted & set(terms(s))), i) for i, s in enumerate(pool)]
    top = sorted((x for x in scored if x[0] > 0), key=lambda x: (-x[0], x[1]))[:n]
    return [pool[i] for _, i in sorted(top, key=lambda x: x[1])]
