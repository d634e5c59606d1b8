"""A per-process cache of each recently replayed run's finished history.

A replay needs the run's whole history, and a long run's grows by a step per
advance: reading all of it every time makes an advance O(steps) in rows fetched.
But a step row that is ``done`` never changes again (every write to a step is
guarded by a status that excludes ``done``, and steps are deleted only with their
finished run by retention, whose id then keys a new run's cache entry apart by its
creation time), so the rows of a run up to its first unfinished step can be kept
and only the rows after them read. The cache is exact, not a guess: what it
returns is what a full read in the same transaction would return. Rows are kept only
once the transaction they were read in has committed (``engine.after_commit``): a
read sees its own transaction's writes, and a commit that failed made none.

Beside the rows, ``DecodedOutputs`` keeps each done row's output decoded, so that a
replay over a long history does not decode every recorded output again at every
advance (see its docstring for why handing it out stays exact).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from fleet.states import StepStatus
from fleet.store.message_cache import NotJSON, fresh_copy
from fleet.store.rows import StepRow

# Bounds: whichever is reached first evicts the least recently replayed runs.
MAX_RUNS = 2048
MAX_BYTES = 64 * 1024 * 1024


def _size(row: StepRow) -> int:
    """Roughly what a cached row holds: its text fields plus a fixed overhead."""
    return 512 + len(row.input or "") + len(row.output or "") + len(row.error or "")


class HistoryCache:
    """Run id → the leading ``done`` rows of its history, in replay order."""

    def __init__(self, max_runs: int = MAX_RUNS, max_bytes: int = MAX_BYTES) -> None:
        self.max_runs = max_runs
        self.max_bytes = max_bytes
        self._runs: OrderedDict[str, tuple[tuple[StepRow, ...], int]] = OrderedDict()
        self._bytes = 0
        # Run id → the key (id and creation time) of its newest entry: what a read that
        # has yet to learn the run's creation time can guess (``HistoryRead.guess``).
        self._keys: dict[str, str] = {}
        self._lock = threading.Lock()
        self.hits = 0  # rows served from the cache, for the benchmarks
        self.outputs = DecodedOutputs()

    def prefix(self, run_id: str) -> tuple[StepRow, ...]:
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None:
                return ()
            self._runs.move_to_end(run_id)
            self.hits += len(entry[0])
            return entry[0]

    def key_of(self, run_id: str) -> str | None:
        """The key of the entry last kept for a run of this id, if one is kept."""
        return self._keys.get(run_id)

    def extend(self, run_id: str, prefix: tuple[StepRow, ...], tail: Sequence[StepRow]) -> None:
        """Keep ``prefix`` plus the leading finished rows of ``tail`` (rows read after it).
        ``run_id``: the entry's key, the run's id and creation time (``HistoryRead``)."""
        done = 0
        while done < len(tail) and tail[done].status == StepStatus.DONE:
            done += 1
        if not done:
            return
        rows = prefix + tuple(tail[:done])
        added = sum(_size(r) for r in tail[:done])
        with self._lock:
            old = self._runs.pop(run_id, None)
            if old is not None and len(old[0]) >= len(rows):
                self._runs[run_id] = old  # a concurrent read kept as much already
                return
            if old is not None:
                self._bytes -= old[1]
            size = old[1] + added if old is not None and old[0] is prefix else None
            if size is None:
                size = sum(_size(r) for r in rows)
            self._runs[run_id] = (rows, size)
            self._bytes += size
            self._keys[run_id.partition("\x00")[0]] = run_id
            while self._runs and (len(self._runs) > self.max_runs or self._bytes > self.max_bytes):
                key, (_, evicted) = self._runs.popitem(last=False)
                self._bytes -= evicted
                if self._keys.get(owner := key.partition("\x00")[0]) == key:
                    del self._keys[owner]

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()
            self._keys.clear()
            self._bytes = 0
        self.outputs.clear()


# How a decoded output is handed out (``DecodedOutputs``): as it is (an immutable
# leaf), as a shallow copy (a dict or list of leaves), as a structural copy (nested
# plain JSON), or decoded again from its text (a secret or cursor inside: not plain
# JSON, so not copied by ``fresh_copy``).
SHARE, COPY, FRESH, DECODE = range(4)
_LEAVES = frozenset({str, int, float, bool, type(None)})
MAX_OUTPUTS = 1 << 18
Entry = tuple[StepRow, int, Any, int]
MAX_OUTPUT_BYTES = 64 * 1024 * 1024


def handout(value: Any) -> int:
    """How ``value`` (a decoded output) is to be handed out: ``SHARE``, ``COPY``,
    ``FRESH`` or ``DECODE``."""
    kind = type(value)
    if kind in _LEAVES:
        return SHARE
    if kind is dict or kind is list:
        for item in value.values() if kind is dict else value:
            if type(item) not in _LEAVES:
                break
        else:
            return COPY
    try:
        fresh_copy(value)
    except (NotJSON, RecursionError):
        return DECODE
    return FRESH


class DecodedOutputs:
    """Done step rows → their outputs, decoded once per process.

    Keyed by the row object itself (held in the entry, so its id cannot be reused
    while the entry lives): the rows the history cache hands every replay are the same
    objects, and a row read afresh is simply decoded again. A done row's output never
    changes, and a blob is stored by its content's hash, so the value decoded from a
    row is the value it would decode to at any later time: the cache is exact. What
    it keeps is never handed out, only what ``handout`` says: a workflow may change
    the value a step returned, and a later replay must see the recorded one again.
    Bounded by entries and by the recorded texts' length, oldest first out."""

    def __init__(self, max_entries: int = MAX_OUTPUTS, max_bytes: int = MAX_OUTPUT_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: dict[int, Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, row: StepRow) -> Entry | None:
        """The row's entry, if kept: ``(row, how to hand it out, value, size)``."""
        entry = self._entries.get(id(row))
        if entry is None or entry[0] is not row:
            return None
        return entry

    def keep(self, row: StepRow, value: Any, length: int) -> Entry:
        """Keep ``value``, decoded from ``row``'s output (``length``: that text's);
        returns its entry (``get``)."""
        mode = handout(value)
        # The decoded value, and the row it keeps alive (its input and output texts)
        # even once the history cache has let it go; roughly.
        size = 2 * length + len(row.input or "") + len(row.output or "") + 256
        entry = (row, mode, None if mode == DECODE else value, size)
        if size > self.max_bytes:
            return entry
        with self._lock:
            old = self._entries.pop(id(row), None)
            if old is not None:
                self._bytes -= old[3]
            self._entries[id(row)] = entry
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                oldest = next(iter(self._entries))
                self._bytes -= self._entries.pop(oldest)[3]
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
