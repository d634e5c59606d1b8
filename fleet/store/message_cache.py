"""A per-process cache of the transcripts' messages.

A message row is written once and never updated; it is deleted only with its
finished run by retention, and the cache keys a run by its id *and* creation time,
so a run enqueued again under a pruned run's id never sees the old messages. So the
messages of a transcript up to the highest position read can be kept, and only the
positions after them read: a step given a 1,000-message window reads the store once
per new batch of messages in each worker process, not once per step. A compaction's
summary (the output of a step that is done) never changes either.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from fleet import codec

MAX_TRANSCRIPTS = 1024
MAX_BYTES = 128 * 1024 * 1024


class NotJSON(Exception):
    """A decoded value holding something other than JSON's dicts, lists and leaves."""


def fresh_copy(value: Any) -> Any:
    """A structural copy of a decoded JSON value: new dicts and lists, the same strings
    and numbers (immutable, so sharing them cannot be seen). Equal to decoding the
    value's text afresh, without reading its bytes; anything else raises ``NotJSON``."""
    kind = type(value)
    if kind is dict:
        return {k: v if type(v) is str else fresh_copy(v) for k, v in value.items()}
    if kind is list:
        return [fresh_copy(v) for v in value]
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    raise NotJSON(type(value).__name__)


class Recorded:
    """One transcript's messages as recorded, positions 0… ``len - 1``: their JSON
    texts, their values, decoded once (what a replay compares its appends with; never
    handed out, only ``fresh`` copies, to a step's view and to the replay), and the
    position of each message recorded as its step's output (``outputs``: step id →
    position)."""

    __slots__ = ("texts", "values", "outputs")

    def __init__(
        self, texts: tuple[str, ...], values: tuple[Any, ...], outputs: dict[str, int]
    ) -> None:
        self.texts = texts
        self.values = values
        self.outputs = outputs

    def __len__(self) -> int:
        return len(self.texts)

    def fresh(self, pos: int) -> Any:
        """Message ``pos`` as if decoded afresh (the caller's own to change): a copy of
        its decoded value sharing its strings, or, for a value that is not plain JSON (a
        cursor, a secret), its text decoded again."""
        try:
            return fresh_copy(self.values[pos])
        except (NotJSON, RecursionError):
            return codec.decode(self.texts[pos])

    def grown(self, texts: list[str], outputs: Sequence[str | None] = ()) -> Recorded:
        """These messages followed by ``texts`` (the positions after them); ``outputs``:
        for each of those, the step whose output it is recorded as (None: its own)."""
        values = tuple(codec.decode(t) for t in texts)
        base = len(self.texts)
        mine = dict(self.outputs)
        mine.update((step, base + i) for i, step in enumerate(outputs) if step is not None)
        return Recorded(self.texts + tuple(texts), self.values + values, mine)


EMPTY = Recorded((), (), {})


class MessageCache:
    """(run id, run creation time, transcript) → its leading recorded messages."""

    def __init__(self, max_transcripts: int = MAX_TRANSCRIPTS, max_bytes: int = MAX_BYTES):
        self.max_transcripts = max_transcripts
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, float, str], tuple[Recorded, int]] = OrderedDict()
        self._summaries: OrderedDict[tuple[str, float, str], str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reads = 0  # store reads made to extend an entry, for the benchmarks

    def get(self, key: tuple[str, float, str]) -> Recorded:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return EMPTY
            self._entries.move_to_end(key)
            return entry[0]

    def keep(self, key: tuple[str, float, str], have: Recorded, grown: Recorded) -> None:
        """Keep ``grown`` (``have`` and the messages read after it) unless a concurrent
        read kept as much already."""
        added = sum(2 * len(t) + 256 for t in grown.texts[len(have) :])
        with self._lock:
            self.reads += 1
            old = self._entries.pop(key, None)
            if old is not None and len(old[0]) >= len(grown):
                self._entries[key] = old
                return
            if old is not None and old[0] is have:
                size = old[1] + added
            else:
                size = sum(2 * len(t) + 256 for t in grown.texts)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (grown, size)
            self._bytes += size
            while self._entries and (
                len(self._entries) > self.max_transcripts or self._bytes > self.max_bytes
            ):
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def summary(self, key: tuple[str, float, str]) -> str | None:
        with self._lock:
            return self._summaries.get(key)

    def keep_summary(self, key: tuple[str, float, str], output: str) -> None:
        with self._lock:
            self._summaries[key] = output
            while len(self._summaries) > self.max_transcripts:
                self._summaries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._summaries.clear()
            self._bytes = 0
