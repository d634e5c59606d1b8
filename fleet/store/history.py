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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from fleet.states import StepStatus
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
        self._lock = threading.Lock()
        self.hits = 0  # rows served from the cache, for the benchmarks

    def prefix(self, run_id: str) -> tuple[StepRow, ...]:
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None:
                return ()
            self._runs.move_to_end(run_id)
            self.hits += len(entry[0])
            return entry[0]

    def extend(self, run_id: str, prefix: tuple[StepRow, ...], tail: Sequence[StepRow]) -> None:
        """Keep ``prefix`` plus the leading finished rows of ``tail`` (rows read after it)."""
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
            while self._runs and (len(self._runs) > self.max_runs or self._bytes > self.max_bytes):
                _, (_, evicted) = self._runs.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()
            self._bytes = 0
