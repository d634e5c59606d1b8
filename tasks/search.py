"""Search over the local corpus (``tasks/corpus/*.md``): word overlap, no index, no network."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from tasks.text import terms


@dataclass(frozen=True)
class Passage:
    """One paragraph of the corpus: its file, its position in the file, and its text."""

    source: str
    position: int
    text: str
    terms: tuple[str, ...]

    @property
    def ref(self) -> str:
        """A stable citation: ``leases-and-fencing.md#2``."""
        return f"{self.source}#{self.position}"


@dataclass(frozen=True)
class Hit:
    """A passage and its score: (distinct query words it holds, their occurrences)."""

    passage: Passage
    score: tuple[int, int]


@lru_cache(maxsize=1)
def corpus() -> tuple[Passage, ...]:
    """Every non-heading paragraph of the corpus, in file-name then position order."""
    folder = resources.files("tasks").joinpath("corpus")
    passages: list[Passage] = []
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".md")), key=lambda f: f.name)
    for f in files:
        paragraphs = [p.strip() for p in f.read_text(encoding="utf-8").split("\n\n")]
        body = [p for p in paragraphs if p and not p.startswith("#")]
        for position, text in enumerate(body, start=1):
            flat = " ".join(text.split())
            passages.append(Passage(f.name, position, flat, tuple(terms(flat))))
    return tuple(passages)


def search_hits(query: str, k: int = 3) -> list[Hit]:
    """The ``k`` best paragraphs for ``query`` with their scores; paragraphs sharing no
    word with the query are left out. A paragraph holding more of the query's distinct
    words wins, then one repeating them more; ties go to the earlier file, then position."""
    if k < 0:
        raise ValueError(f"k must be at least 0, got {k}")
    wanted = set(terms(query))
    hits = [Hit(p, _score(wanted, p.terms)) for p in corpus()]
    hits = [h for h in hits if h.score[0] > 0]
    hits.sort(key=lambda h: (-h.score[0], -h.score[1], h.passage.source, h.passage.position))
    return hits[:k]


def search(query: str, k: int = 3) -> list[str]:
    """The text of the ``k`` paragraphs of the corpus that best match ``query``."""
    return [h.passage.text for h in search_hits(query, k)]


def _score(wanted: set[str], words: tuple[str, ...]) -> tuple[int, int]:
    return len(wanted.intersection(words)), sum(1 for w in words if w in wanted)
