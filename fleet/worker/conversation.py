"""A transcript as the workflow sees it during a replay (``wf.transcript(name)``).

The workflow runs from the top on every replay, so it appends every message again:
the k-th append of a replay is checked against the recorded k-th message (a
mismatch is ``NonDeterminism``, naming the position; compared as Python values, so
``1``, ``1.0`` and ``true`` are the same number, at C speed), and only appends past the
recorded end are new. New messages wait in the ``Conversations`` of the replay and
are written with the next steps it records (``Ledger.record_steps``), in the same
transaction, before any step that is given them can run. What the workflow holds is
the messages themselves; what a step is given is a cursor (``fleet.transcripts``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from fleet import codec
from fleet.errors import NonDeterminism, PayloadError
from fleet.registry import check_name
from fleet.store.message_cache import Recorded
from fleet.store.messages import SAME_AS_OUTPUT, NewCompaction, NewMessage
from fleet.store.rows import RunRow, StepRow
from fleet.transcripts import Cursor
from fleet.worker.runtime import Runtime


@dataclass(frozen=True)
class Compacted:
    """A compaction the replay has passed: its summary leads the model's view."""

    number: int
    upto: int
    step_id: str
    summary: list[dict[str, Any]]


def _short(message: Any) -> str:
    try:
        text = codec.encode(message, what="message", limit=1 << 30)
    except PayloadError:
        text = repr(message)
    return text if len(text) <= 120 else text[:117] + "..."


_NOT_HELD = object()


class _Held(Sequence[dict[str, Any]]):
    """Messages the workflow holds: a plain sequence of them."""

    __slots__ = ()
    _messages: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self._messages)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> Any:
        return self._messages[index]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._messages)


class Transcript(_Held):
    """A run's append-only message log, in the workflow (see CONTRACT.md)."""

    def __init__(self, owner: Conversations, name: str, recorded: Recorded) -> None:
        self.name = name
        self.run_id = owner.run_id
        self._owner = owner
        self._recorded = recorded
        self._messages: list[dict[str, Any]] = []
        self.compacted: Compacted | None = None  # the latest compaction passed
        self.compactions = 0  # compact() calls made on it so far in this replay

    def append(self, message: dict[str, Any]) -> None:
        """Record ``message`` (a JSON object) once; on replay, check it is the same."""
        if not isinstance(message, dict):
            raise TypeError(
                f"transcript {self.name!r}: a message is a JSON object (a dict), "
                f"not {type(message).__name__}"
            )
        pos = len(self._messages)
        recorded = self._recorded
        if pos < len(recorded.texts):
            # A message handed out by ``Conversations.output`` shares the recorded
            # one's strings, so this compares them by identity, not byte by byte.
            if message != recorded.values[pos]:
                raise NonDeterminism(
                    f"non-determinism in run {self.run_id}: message {pos} of transcript "
                    f"{self.name!r} is not the one recorded (recorded "
                    f"{_short(recorded.values[pos])}, appended {_short(message)})"
                )
        else:
            self._owner.new_message(self.name, pos, message)
        self._messages.append(message)

    def window(self) -> Window:
        """The model's view now: the latest compaction's summary, then the raw
        messages after the point it covers (all of them before any compaction)."""
        return Window(self, self.compacted, len(self._messages))

    def fleet_cursor(self) -> Cursor:
        c = self.compacted
        window = None if c is None else (c.upto, c.step_id)
        return Cursor(self.run_id, self.name, 0, len(self._messages), window=window)

    def between(self, start: int, end: int) -> list[dict[str, Any]]:
        return self._messages[start:end]

    def __repr__(self) -> str:
        return f"<transcript {self.name!r} of run {self.run_id}: {len(self)} messages>"


class Window(_Held):
    """Part of a transcript as a model is shown it: a compaction's summary (if any),
    then raw messages ``start`` to ``end``. Fixed when made; given to a step as a
    cursor. (Slotted: a long loop makes one per turn on every replay.)"""

    __slots__ = ("_transcript", "_compacted", "start", "end", "_head", "_built")

    def __init__(
        self,
        transcript: Transcript,
        compacted: Compacted | None,
        end: int,
        start: int | None = None,
    ) -> None:
        self._transcript = transcript
        self._compacted = compacted
        self.start = (compacted.upto if compacted else 0) if start is None else start
        self.end = end
        self._head: Sequence[dict[str, Any]] = compacted.summary if compacted else ()
        self._built: list[dict[str, Any]] | None = None

    # Built only if the workflow reads it: a window given to a step is only a cursor,
    # and copying every message at every turn would make a long loop quadratic.
    @property
    def _messages(self) -> list[dict[str, Any]]:  # type: ignore[override]
        if self._built is None:
            self._built = [*self._head, *self._transcript.between(self.start, self.end)]
        return self._built

    def __len__(self) -> int:
        return len(self._head) + self.end - self.start

    def fleet_cursor(self) -> Cursor:
        summary = self._compacted.step_id if self._compacted else None
        return Cursor(self._transcript.run_id, self._transcript.name, self.start, self.end, summary)


class Conversations:
    """A replay's transcripts, the messages and compactions it has yet to write, and
    which step's output each value the replay handed out is (so a message is shown
    with the step that produced it)."""

    def __init__(self, rt: Runtime, run: RunRow) -> None:
        self._rt = rt
        self.run_id = run.id
        self._created_at = run.created_at
        self._open: dict[str, Transcript] = {}
        self._recorded: dict[str, Recorded] = {}  # what each open transcript had recorded
        self.messages: list[NewMessage] = []
        self.compactions: list[NewCompaction] = []
        self._producers: dict[int, tuple[Any, str, str | None]] = {}
        # The recorded size of the outputs handed out (and kept alive above): roughly
        # what a live workflow holds (fleet/worker/live.py bounds it).
        self.held_bytes = 0

    def rebind(self, rt: Runtime) -> None:
        """A live workflow's later advance: read and store through its runtime."""
        self._rt = rt

    def open(self, name: str) -> Transcript:
        check_name(name, "transcript")
        found = self._open.get(name)
        if found is None:
            recorded = self._recorded[name] = self._rt.queries.recorded(
                self.run_id, self._created_at, name
            )
            found = self._open[name] = Transcript(self, name, recorded)
        return found

    def output(self, rec: StepRow) -> Any:
        """The recorded output of step ``rec`` (done), as the workflow is handed it (and
        kept alive, so ids stay unique): the workflow's own to change, equal to decoding
        the output afresh (``Payloads.output``). When a transcript holds it as a message
        recorded as that output, a fresh copy of the message's decoded value sharing its
        strings (``Recorded.fresh``): the append comparing it with that message then
        finds each string identical instead of reading its bytes."""
        step_id = rec.step_id
        value = self._held(step_id) if self._open else _NOT_HELD
        if value is _NOT_HELD:
            value = self._rt.payloads.output(rec)
        self._producers[id(value)] = (value, step_id, rec.output)
        self.held_bytes += len(rec.output or "")
        return value

    def _held(self, step_id: str) -> Any:
        for recorded in self._recorded.values():
            pos = recorded.outputs.get(step_id)
            if pos is not None:
                return recorded.fresh(pos)
        return _NOT_HELD

    def new_message(self, name: str, pos: int, message: dict[str, Any]) -> None:
        what = f"message {pos} of transcript {name!r}"
        text = codec.encode(message, what=what, limit=self._rt.settings.max_blob_bytes)
        producer = self._producer(message)
        if producer is not None and producer[1] is message and producer[2] == text:
            # The step's output itself, unchanged: recorded once, as that output.
            body = SAME_AS_OUTPUT
        else:
            body = self._rt.payloads.store(text)
        step_id = producer[0] if producer is not None else None
        self.messages.append(NewMessage(name, pos, body, step_id))

    def _producer(self, message: dict[str, Any]) -> tuple[str, Any, str | None] | None:
        """The step whose output the message (or its content) is: its id, that output's
        value and its recorded text."""
        for value in (message, message.get("content")):
            found = self._producers.get(id(value))
            if found is not None and found[0] is value:
                return found[1], value, found[2]
        return None

    def unfinished(self) -> str | None:
        """A transcript the replay did not append all its recorded messages to, as the
        error of a workflow that returned: its code no longer says what it said."""
        for name, t in self._open.items():
            count = len(self._recorded[name])
            if len(t) < count:
                return (
                    f"non-determinism in run {self.run_id}: the workflow returned after "
                    f"appending {len(t)} messages to transcript {t.name!r} but "
                    f"{count} are recorded"
                )
        return None

    def taken(self) -> tuple[list[NewMessage], list[NewCompaction]]:
        """What is to be written now; cleared, as the caller writes it."""
        out = (self.messages, self.compactions)
        self.messages, self.compactions = [], []
        return out
