"""Transcripts' vocabulary: the cursor a step is given instead of a copy of the
messages, the records the API returns, and the rules every floor shares.

A transcript is a run's append-only log of messages (JSON objects; the OpenAI-style
chat shape ``role``, ``content``, ``tool_calls``, ``tool_call_id``, ``name`` is the
convention). What a step records of one is a ``Cursor``: the run, the transcript's
name and a range of positions, plus the compaction whose summary leads it (a
window). Its size does not depend on how long the history is. The codec writes it
as ``{"$fleet_transcript": {...}}`` (user keys beginning with "$" are escaped, so
user data cannot be taken for one) and reads it back through the ``reading`` hook:
inside a step, the worker's reader turns it into a read-only sequence of the
messages; anywhere else it stays a ``Cursor``, which cannot be read.

How a person reads a tool call (``tool_call_line``) is here too, so that every view
of a transcript (``fleet transcript``, the console) writes it the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, overload

from fleet.errors import PayloadError

MARKER = "$fleet_transcript"
DEFAULT = "main"


@dataclass(frozen=True, slots=True)
class Cursor:
    """Messages ``start`` to ``end`` (positions, end excluded) of transcript ``name`` of
    run ``run_id``; led by the summary recorded as the output of step ``summary`` of
    that run when this is a window over a compaction. A whole transcript's cursor
    also carries ``window``: where the model's view of it began when it was given
    (the position and summarize step of the compaction then current)."""

    run_id: str
    name: str
    start: int
    end: int
    summary: str | None = None
    window: tuple[int, str] | None = None

    def windowed(self) -> Cursor:
        """The model's view of this cursor: the window it carries, or itself."""
        if self.window is None:
            return self
        upto, step_id = self.window
        return Cursor(self.run_id, self.name, upto, self.end, step_id)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"run": self.run_id, "name": self.name, "end": self.end}
        if self.start:
            body["start"] = self.start
        if self.summary is not None:
            body["summary"] = self.summary
        if self.window is not None:
            body["window"] = list(self.window)
        return {MARKER: body}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Cursor:
        body = obj.get(MARKER)
        try:
            assert isinstance(body, dict)
            run_id, name, end = body["run"], body["name"], body["end"]
            start, summary = body.get("start", 0), body.get("summary")
            window = body.get("window")
            assert isinstance(run_id, str) and isinstance(name, str)
            assert type(start) is int and type(end) is int and 0 <= start <= end
            assert summary is None or isinstance(summary, str)
            if window is not None:
                upto, step_id = window
                assert type(upto) is int and 0 <= upto <= end and isinstance(step_id, str)
                window = (upto, step_id)
        except (AssertionError, KeyError, TypeError, ValueError):
            raise PayloadError(f"recorded transcript cursor is malformed: {obj!r:.200}") from None
        return cls(run_id, name, start, end, summary, window)


class Cursored(Protocol):
    """What the codec records as a cursor: a transcript or a window of one."""

    def fleet_cursor(self) -> Cursor: ...


class Reader(Protocol):
    """Turns a recorded cursor into the messages it stands for (the worker's, in a step)."""

    def view(self, cursor: Cursor) -> Any: ...


_reader: ContextVar[Reader | None] = ContextVar("fleet_transcript_reader", default=None)


@contextmanager
def reading(reader: Reader) -> Iterator[None]:
    """Cursors decoded meanwhile (a step's input) become ``reader``'s views."""
    token = _reader.set(reader)
    try:
        yield
    finally:
        _reader.reset(token)


def from_json(obj: dict[str, Any]) -> Any:
    """A decoded cursor marker: the current reader's view of it, or the bare cursor."""
    cursor = Cursor.from_json(obj)
    reader = _reader.get()
    return cursor if reader is None else reader.view(cursor)


def to_json(value: Any) -> dict[str, Any] | None:
    """The marker of a transcript, a window or a view; None for anything else."""
    if isinstance(value, Cursor):
        return value.to_json()
    make = getattr(type(value), "fleet_cursor", None)
    return make(value).to_json() if make is not None else None


# The roles a chat message may have (OpenAI's, and "developer", its newer "system").
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def summary_messages(output: Any) -> list[dict[str, Any]]:
    """A summarize step's output as the messages that lead a window: a message, a list
    of them, or a string (a system message holding it). Each message must be one: a
    ``role`` among ``ROLES`` and a ``content`` (an assistant's may have ``tool_calls``
    instead); anything else is refused, in one line naming what is wrong."""
    if isinstance(output, str):
        return [{"role": "system", "content": output}]
    if isinstance(output, dict):
        messages = [output]
    elif isinstance(output, list) and all(isinstance(m, dict) for m in output):
        messages = list(output)
    else:
        raise PayloadError(
            "a compaction's summary must be a message (a JSON object), a list of them or a "
            f"string; the summarize step returned {type(output).__name__}"
        )
    for i, message in enumerate(messages):
        wrong = _not_a_message(message)
        if wrong:
            where = "summary" if isinstance(output, dict) else f"summary message {i}"
            raise PayloadError(f"a compaction's {where} is not a message: {wrong}")
    return messages


def _not_a_message(message: dict[str, Any]) -> str | None:
    """What keeps ``message`` from being a chat message, or None."""
    role = message.get("role")
    if not isinstance(role, str):
        found = "none" if role is None else f"{type(role).__name__} {role!r:.40}"
        return f"its role must be a string, one of {', '.join(sorted(ROLES))} (found {found})"
    if role not in ROLES:
        return f"role {role!r:.40} is not one of {', '.join(sorted(ROLES))}"
    if "content" not in message and not (role == "assistant" and "tool_calls" in message):
        return f"a {role} message needs a content"
    return None


@dataclass(frozen=True)
class MessageInfo:
    """One recorded message: its position, the message, the step whose output it is
    (None: the workflow wrote it), when it was recorded."""

    position: int
    message: dict[str, Any]
    step_id: str | None
    at: float


@dataclass(frozen=True)
class CompactionInfo:
    """One compaction: messages before ``upto`` summarized by step ``step_id`` (over
    raw messages from ``start``, led by compaction ``base``'s summary when it has one);
    ``summary`` once that step is done (``status``)."""

    number: int
    start: int
    upto: int
    base: int | None
    step_id: str
    status: str
    summary: list[dict[str, Any]] | None
    at: float


@dataclass(frozen=True)
class TranscriptInfo:
    """A transcript as recorded: every raw message, and every compaction of it."""

    run_id: str
    name: str
    messages: list[MessageInfo]
    compactions: list[CompactionInfo]

    @property
    def current(self) -> CompactionInfo | None:
        """The compaction the model's view starts from: the latest that is done."""
        done = [c for c in self.compactions if c.summary is not None]
        return done[-1] if done else None

    @classmethod
    def from_rows(
        cls,
        run_id: str,
        name: str,
        messages: Sequence[tuple[Any, ...]],
        compactions: Sequence[tuple[Any, ...]],
        decode: Any,
    ) -> TranscriptInfo:
        """From the store's rows (``Queries.transcript``); ``decode`` reads a JSON text.
        A summary that cannot be read as messages is shown as its text."""
        found = [MessageInfo(pos, decode(body), step, at) for pos, body, step, at in messages]
        comps = []
        for number, start, upto, base, step_id, status, output, at in compactions:
            summary = None
            if status == "done":
                try:
                    summary = summary_messages(decode(output))
                except PayloadError:
                    summary = [{"role": "system", "content": str(output)}]
            comps.append(CompactionInfo(number, start, upto, base, step_id, status, summary, at))
        return cls(run_id, name, found, comps)

    def raw(self) -> list[dict[str, Any]]:
        return [m.message for m in self.messages]

    def window(self) -> list[dict[str, Any]]:
        """The model's view: the current compaction's summary, then the raw messages
        after the point it covers."""
        current = self.current
        if current is None:
            return self.raw()
        assert current.summary is not None
        return [*current.summary, *(m.message for m in self.messages[current.upto :])]


class Messages(Sequence[dict[str, Any]]):
    """A read-only sequence of messages (``list(chat)``, ``len(chat)``, ``chat[-5:]``):
    a slice is a plain list; a message is the caller's own copy to change."""

    def __init__(self, load: Any, length: int) -> None:
        self._load = load  # (start, end) -> list of messages
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, stride = index.indices(self._length)
            if stride != 1:
                return self._load(0, self._length)[index]
            return self._load(start, stop) if start < stop else []
        i = index + self._length if index < 0 else index
        if not 0 <= i < self._length:
            raise IndexError("transcript index out of range")
        return self._load(i, i + 1)[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._load(0, self._length))


def tool_call_line(call: Any, limit: int = 300) -> str:
    """``→ name(args) [id]`` for a tool call in OpenAI form (``function.arguments``, a
    JSON string) or the simpler ``{"id", "name", "args"}``; anything else as JSON. The
    arguments (or the JSON) are cut to ``limit`` characters. Plain text: a view escapes
    it for its medium (a terminal's control characters, HTML)."""
    if not isinstance(call, dict):
        return f"→ {_clip(_as_json(call), limit)}"
    fn = call.get("function")
    if isinstance(fn, dict) and "name" in fn:
        name, args = fn.get("name"), _arguments(fn.get("arguments"))
    elif "name" in call:
        raw = call["args"] if "args" in call else call.get("arguments")
        name, args = call.get("name"), _as_json(raw) if "args" in call else _arguments(raw)
    else:
        return f"→ {_clip(_as_json(call), limit)}"
    ident = f" [{call['id']}]" if call.get("id") is not None else ""
    return f"→ {name}({_clip(args, limit)}){ident}"


def _arguments(arguments: Any) -> str:
    """OpenAI's arguments are JSON text: shown compact when they parse, as given if not."""
    if not isinstance(arguments, str):
        return _as_json(arguments)
    try:
        return _as_json(json.loads(arguments))
    except ValueError:
        return arguments


def _as_json(value: Any) -> str:
    # What JSON cannot hold (a Secret, whose repr names it and never holds its value)
    # is shown as its repr.
    return json.dumps(value, default=repr)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
