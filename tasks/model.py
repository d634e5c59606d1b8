"""An offline, deterministic stand-in for a language model, and the hook for a real one.

Same input, same output and same usage: no network, no randomness, no clock. Tokens
are whitespace-separated words. ``FLEET_MODEL_LATENCY`` (seconds) makes each call
slow on purpose; ``FLEET_MODEL="module:attr"`` plugs in another model object.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
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

    def _complete(self, prompt: str, text: str, data: dict[str, Any] | None = None) -> Completion:
        _pause()
        inp, out = word_count(prompt), word_count(text)
        cost = round(inp * INPUT_PRICE + out * OUTPUT_PRICE, 10)
        return Completion(self.name, text, inp, out, cost, data)


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
