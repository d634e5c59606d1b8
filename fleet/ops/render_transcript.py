"""Rich views of a transcript as a person reads it, and its JSON form (``fleet
transcript``).

Three views of one ``TranscriptInfo``: ``raw``, every message in order with its
position, role, the step that produced it, its tool calls, and a marker line where a
compaction's summary begins to stand for what came before; ``window``, what the model
is shown (the current compaction's summary, marked as such, then the raw messages
after it); and the compactions themselves. The rule of ``fleet.ops.render`` holds:
every stored value is text, never Rich markup, its control characters escaped. Only
the Rich views clip long content; the JSON form never does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from fleet import transcripts
from fleet.ops.render import as_json, clip, one_line, plain, status_text
from fleet.transcripts import CompactionInfo, MessageInfo, TranscriptInfo

VIEWS = ("raw", "window")
CLIP = 400  # characters of a message's content shown before "… (N more chars)"
CALL_CLIP = 300  # characters of one tool call's line
SUMMARY_CLIP = 60  # characters of a summary's first line in the compactions table
ROLE_STYLE = {"user": "green", "assistant": "cyan", "tool": "yellow", "system": "magenta"}
INDENT = 4


def render_transcript(info: TranscriptInfo, *, view: str = "raw") -> RenderableType:
    """Every message (``raw``) or the model's view (``window``) of one transcript."""
    return Group(
        *transcript_lines(info, len(info.messages), view, lambda start: info.messages[start:])
    )


def transcript_lines(
    head: TranscriptInfo,
    length: int,
    view: str,
    messages: Callable[[int], Iterable[MessageInfo]],
) -> Iterator[Text]:
    """The lines of a view, each made as ``messages(start)`` hands over the messages from
    position ``start`` on: a long transcript is printed as it is read, never held whole.
    ``head`` gives the transcript's run, name and compactions; ``length``, its messages."""
    if view not in VIEWS:
        raise ValueError(f"unknown transcript view {view!r}: one of {', '.join(VIEWS)}")
    yield _heading(head, view, length)
    yield from _raw(head, length, messages(0)) if view == "raw" else _window(head, length, messages)


def render_compactions(info: TranscriptInfo, length: int | None = None) -> RenderableType:
    """A table of the transcript's compactions, the current one marked (``length``: how
    many messages it has, when ``info`` holds none of them)."""
    heading = _heading(info, "compactions", len(info.messages) if length is None else length)
    if not info.compactions:
        return Group(heading, plain("no compactions: the model sees every message"))
    current = info.current
    table = Table(title=None)
    for col in ("#", "covers", "folds", "summarize step", "status"):
        table.add_column(col, no_wrap=True)
    # One row per compaction: a long first line is cut, never wrapped.
    table.add_column("summary", no_wrap=True, overflow="ellipsis", max_width=SUMMARY_CLIP)
    table.add_column("", no_wrap=True)
    for c in info.compactions:
        first = _first_line(c.summary[0]) if c.summary else ""
        table.add_row(
            str(c.number),
            covered(c.upto),
            _folds(c),
            plain(c.step_id),
            status_text(c.status),
            plain(clip(first, SUMMARY_CLIP)),
            Text("current", style="bold") if c is current else "",
        )
    return Group(heading, table)


def transcript_json(info: TranscriptInfo, view: str) -> dict[str, Any]:
    """The JSON form of a view (``raw``, ``window`` or ``compactions``): nothing clipped."""
    doc = _json_head(info, view)
    if view != "compactions":
        doc["messages"] = list(_json_messages(info, view, lambda start: info.messages[start:]))
    doc["compactions"] = _json_compactions(info)
    return doc


def transcript_json_text(
    head: TranscriptInfo, view: str, messages: Callable[[int], Iterable[MessageInfo]]
) -> Iterator[str]:
    """``transcript_json`` of the ``raw`` or ``window`` view as JSON text, in pieces, each
    message written as ``messages(start)`` hands it over (``transcript_lines``' way)."""
    yield as_json(_json_head(head, view))[:-1] + ', "messages": ['
    for i, item in enumerate(_json_messages(head, view, messages)):
        yield (", " if i else "") + as_json(item)
    yield '], "compactions": ' + as_json(_json_compactions(head)) + "}"


def _json_head(info: TranscriptInfo, view: str) -> dict[str, Any]:
    if view not in (*VIEWS, "compactions"):
        raise ValueError(f"unknown transcript view {view!r}: one of raw, window, compactions")
    doc: dict[str, Any] = {"run_id": info.run_id, "name": info.name, "view": view}
    if view == "window":
        doc["compaction"] = None if info.current is None else info.current.number
    return doc


def _json_messages(
    info: TranscriptInfo, view: str, messages: Callable[[int], Iterable[MessageInfo]]
) -> Iterator[Any]:
    """The view's messages: raw, each with its position, step and time; the window, the
    model's view (``TranscriptInfo.window``: the current summary, then what follows)."""
    current = info.current
    if view == "raw":
        for m in messages(0):
            yield {"position": m.position, "step_id": m.step_id, "at": m.at, "message": m.message}
        return
    if current is None or current.summary is None:
        yield from (m.message for m in messages(0))
        return
    yield from current.summary
    yield from (m.message for m in messages(current.upto))


def _json_compactions(info: TranscriptInfo) -> list[dict[str, Any]]:
    current = info.current
    return [
        {
            "number": c.number,
            "start": c.start,
            "upto": c.upto,
            "base": c.base,
            "step_id": c.step_id,
            "status": c.status,
            "summary": c.summary,
            "at": c.at,
            "current": c is current,
        }
        for c in info.compactions
    ]


# --- the pieces ------------------------------------------------------------------------


def _heading(info: TranscriptInfo, view: str, length: int) -> Text:
    current = info.current
    now = f", the model's view starts at compaction {current.number}" if current else ""
    return Text.assemble(
        ("transcript ", "bold"),
        plain(info.name, "bold"),
        " of run ",
        plain(info.run_id, "bold"),
        plain(
            f" ({view}): {length} message(s), {len(info.compactions)} compaction(s){now}",
            "dim",
        ),
    )


def _raw(head: TranscriptInfo, length: int, found: Iterable[MessageInfo]) -> Iterator[Text]:
    """Every message, a compaction's marker before the first message it does not cover."""
    if not length and not head.compactions:
        yield plain("no messages", "dim")
        return
    current = head.current
    at: dict[int, list[CompactionInfo]] = {}
    for c in head.compactions:
        at.setdefault(min(c.upto, length), []).append(c)
    for m in found:
        yield from (marker(c, c is current) for c in at.pop(m.position, []))
        yield from message_view(m.message, str(m.position), m.step_id)
    for upto in sorted(at):  # those past the last message
        yield from (marker(c, c is current) for c in at[upto])


def _window(
    head: TranscriptInfo, length: int, messages: Callable[[int], Iterable[MessageInfo]]
) -> Iterator[Text]:
    current = head.current
    if current is None or current.summary is None:
        yield plain("no compaction done: the model sees every message", "dim")
        yield from _raw_messages(messages(0))
        return
    yield plain(
        f"── summary (compaction {current.number}, {current.step_id}): "
        f"stands for {covered(current.upto)} ──",
        "bold magenta",
    )
    for message in current.summary:
        yield from message_view(message, "summary", current.step_id)
    yield plain(f"── after the summary: {messages_range(current.upto, length)} ──", "dim")
    yield from _raw_messages(messages(current.upto))


def _raw_messages(found: Iterable[MessageInfo]) -> Iterator[Text]:
    shown = False
    for m in found:
        shown = True
        yield from message_view(m.message, str(m.position), m.step_id)
    if not shown:
        yield plain("no messages", "dim")


def marker(c: CompactionInfo, current: bool) -> Text:
    """The line drawn where a compaction's summary begins to stand for what came before."""
    label = f"compaction {c.number} ({c.step_id})"
    now = ", current" if current else ""
    if c.status == "done":
        return plain(f"── {label}: {covered(c.upto)} summarized{now} ──", "bold magenta")
    return plain(f"── {label}: {covered(c.upto)}, summary {c.status} ──", "dim magenta")


def covered(upto: int) -> str:
    """The raw messages a compaction up to ``upto`` stands for."""
    return messages_range(0, upto)


def messages_range(start: int, end: int) -> str:
    """Positions ``start`` to ``end`` (excluded) in words."""
    return (
        "no messages"
        if end <= start
        else f"message{'s' if end - start > 1 else ''} {span(start, end)}"
    )


def span(start: int, end: int) -> str:
    return str(start) if end - start == 1 else f"{start}–{end - 1}"


def _folds(c: CompactionInfo) -> Text:
    """What the summarize step was given: the previous summary and raw messages."""
    raw = f"raw {span(c.start, c.upto)}" if c.upto > c.start else "no raw messages"
    return plain(raw if c.base is None else f"summary {c.base} + {raw}")


def message_view(message: Any, position: str, step_id: str | None) -> list[Text]:
    """One message: a head line (position, role, producing step), its content, its tool
    calls, one line each."""
    if not isinstance(message, dict):
        return [_head(position, "?", step_id), _clipped(as_json(message))]
    role = str(message.get("role", "?"))
    head = _head(position, role, step_id)
    if message.get("name") is not None:
        head.append_text(plain(f" name {message['name']}", "dim"))
    if message.get("tool_call_id") is not None:
        head.append_text(plain(f" for tool call {message['tool_call_id']}", "yellow"))
    parts = [head]
    content = message.get("content")
    if content is not None and content != "":
        text = content if isinstance(content, str) else as_json(content)
        parts.append(_clipped(text))
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        parts.extend(plain(_indent(tool_call_line(c)), "blue") for c in calls)
    elif calls is not None:
        parts.append(plain(_indent(one_line(f"tool_calls: {clip(as_json(calls), CALL_CLIP)}"))))
    return parts


def _head(position: str, role: str, step_id: str | None) -> Text:
    return Text.assemble(
        plain(f"#{position}" if position.isdigit() else position, "dim"),
        " ",
        plain(one_line(role), ROLE_STYLE.get(role, "bold")),
        plain(f" · {step_id or 'workflow'}", "dim"),
    )


def _clipped(text: str) -> Text:
    """Content as indented text, cut after ``CLIP`` characters with what was left out."""
    shown = _indent(text[:CLIP])
    if len(text) <= CLIP:
        return plain(shown)
    return Text.assemble(plain(shown), plain(f"… ({len(text) - CLIP} more chars)", "dim"))


def _indent(text: str) -> str:
    # By hand, not rich.padding.Padding: that pads every line to the console's width.
    return "\n".join(" " * INDENT + line for line in text.split("\n"))


def tool_call_line(call: Any) -> str:
    """``→ name(args) [id]`` (``fleet.transcripts.tool_call_line``) on one line."""
    return one_line(transcripts.tool_call_line(call, CALL_CLIP))


def _first_line(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else message
    text = content if isinstance(content, str) else as_json(content)
    return one_line(text.strip().splitlines()[0] if text.strip() else "")
