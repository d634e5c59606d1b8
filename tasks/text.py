"""Small text helpers shared by the stand-in model and the corpus search."""

from __future__ import annotations

import re

STOP_WORDS: frozenset[str] = frozenset(
    {
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "been",
        "but",
        "by",
        "can",
        "do",
        "does",
        "for",
        "from",
        "has",
        "have",
        "how",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "may",
        "more",
        "not",
        "of",
        "on",
        "one",
        "or",
        "so",
        "such",
        "than",
        "that",
        "the",
        "their",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "to",
        "too",
        "was",
        "what",
        "when",
        "where",
        "which",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "without",
        "you",
        "your",
    }
)

_TERM = re.compile(r"[a-z0-9]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def word_count(text: str) -> int:
    """Whitespace-separated words: the stand-in's token count."""
    return len(text.split())


def stem(word: str) -> str:
    """A deliberately tiny plural folding: ``leases`` → ``lease``, ``retries`` → ``retry``."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def terms(text: str) -> list[str]:
    """Lowercase content words of ``text``, stop words and single letters removed."""
    return [stem(w) for w in _TERM.findall(text.lower()) if len(w) > 1 and w not in STOP_WORDS]


def sentences(text: str) -> list[str]:
    """``text`` split into sentences on ``.``, ``!`` or ``?`` followed by whitespace."""
    flat = " ".join(text.split())
    return [s for s in _SENTENCE_END.split(flat) if s]
