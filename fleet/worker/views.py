"""What a step is given for a transcript cursor in its input: a read-only sequence
of the messages it stands for, read through the process's message cache.

A view reads nothing until it is read, then at most one statement for the raw
messages this process has not read yet (none once the cache holds them) and one for
a window's summary (kept once read). Each read hands out the messages afresh (copies
of the cached decoded values sharing only their immutable strings and numbers,
``Recorded.fresh``), so a step may change what it is given without changing what
another step is given.
"""

from __future__ import annotations

from typing import Any

from fleet import codec
from fleet.errors import PayloadError
from fleet.store.message_cache import Recorded
from fleet.store.rows import RunRow
from fleet.transcripts import Cursor, Messages, summary_messages
from fleet.worker.runtime import Runtime


class TranscriptView(Messages):
    """A transcript, or a window of one, in a step: ``list(view)``, ``len(view)``,
    ``view[-5:]``; ``view.window()`` is the model's view of it."""

    def __init__(self, reader: StepReader, cursor: Cursor) -> None:
        self.cursor = cursor
        self.name = cursor.name
        self.run_id = cursor.run_id
        self._reader = reader
        self._head = reader.summary(cursor)
        super().__init__(self._load, len(self._head) + cursor.end - cursor.start)

    def _load(self, start: int, end: int) -> list[dict[str, Any]]:
        head = self._head
        out: list[dict[str, Any]] = [codec.decode(t) for t in head[start:end]]
        first = max(start - len(head), 0) + self.cursor.start
        last = end - len(head) + self.cursor.start
        if last > first:
            fresh = self._reader.recorded(self.cursor, last).fresh
            out.extend(fresh(pos) for pos in range(first, last))
        return out

    def window(self) -> TranscriptView:
        """What a model is shown: the summary of the compaction current when the
        transcript was given, then the raw messages after it (a window is its own)."""
        windowed = self.cursor.windowed()
        return self if windowed is self.cursor else TranscriptView(self._reader, windowed)

    def fleet_cursor(self) -> Cursor:
        return self.cursor

    def __repr__(self) -> str:
        c = self.cursor
        return f"<transcript {c.name!r} of run {c.run_id}: messages {c.start}-{c.end}>"


class StepReader:
    """Turns the cursors in one step's input into views (``fleet.transcripts.reading``)."""

    def __init__(self, rt: Runtime, run: RunRow) -> None:
        self._rt = rt
        self._created = {run.id: run.created_at}

    def view(self, cursor: Cursor) -> TranscriptView:
        return TranscriptView(self, cursor)

    def _created_at(self, run_id: str) -> float:
        created = self._created.get(run_id)
        if created is None:
            run = self._rt.queries.run(run_id)
            if run is None:
                raise PayloadError(f"a transcript cursor names run {run_id!r}, which is gone")
            created = self._created[run_id] = run.created_at
        return created

    def recorded(self, cursor: Cursor, end: int) -> Recorded:
        """The transcript's recorded messages, at least up to ``end``."""
        recorded = self._rt.queries.recorded(
            cursor.run_id, self._created_at(cursor.run_id), cursor.name, end
        )
        if len(recorded) < end:
            raise PayloadError(
                f"transcript {cursor.name!r} of run {cursor.run_id} has {len(recorded)} "
                f"messages recorded; the step was given {end}"
            )
        return recorded

    def summary(self, cursor: Cursor) -> tuple[str, ...]:
        """The JSON texts of the summary messages leading a window (none without one)."""
        if cursor.summary is None:
            return ()
        text = self._rt.queries.summary(
            cursor.run_id, self._created_at(cursor.run_id), cursor.summary
        )
        if text is None:
            raise PayloadError(
                f"compaction step {cursor.summary!r} of run {cursor.run_id} has no summary"
            )
        return tuple(
            codec.encode(m, what="summary", limit=1 << 30)
            for m in summary_messages(codec.decode(text))
        )
