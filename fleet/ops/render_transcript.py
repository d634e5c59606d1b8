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
    if view == "raw":
        parts = _raw(info)
    elif view == "window":
        parts = _window(info)
    else:
        raise ValueError(f"unknown transcript view {view!r}: one of {', '.join(VIEWS)}")
    return Group(_heading(info, view), *parts)


def render_compactions(info: TranscriptInfo) -> RenderableType:
    """A table of the transcript's compactions, the current one marked."""
    if not info.compactions:
        return Group(
            _heading(info, "compactions"), plain("no compactions: the model sees every message")
        )
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
    return Group(_heading(info, "compactions"), table)


def transcript_json(info: TranscriptInfo, view: str) -> dict[str, Any]:
    """The JSON form of a view (``raw``, ``window`` or ``compactions``): nothing clipped."""
    if view not in (*VIEWS, "compactions"):
        raise ValueError(f"unknown transcript view {view!r}: one of raw, window, compactions")
    current = info.current
    doc: dict[str, Any] = {"run_id": info.run_id, "name": info.name, "view": view}
    if view == "raw":
        doc["messages"] = [
            {"position": m.position, "step_id": m.step_id, "at": m.at, "message": m.message}
            for m in info.messages
        ]
    elif view == "window":
        doc["compaction"] = None if current is None else current.number
        doc["messages"] = info.window()
    doc["compactions"] = [
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
    return doc


# --- the pieces ------------------------------------------------------------------------


def _heading(info: TranscriptInfo, view: str) -> Text:
    current = info.current
    now = f", the model's view starts at compaction {current.number}" if current else ""
    return Text.assemble(
        ("transcript ", "bold"),
        plain(info.name, "bold"),
        " of run ",
        plain(info.run_id, "bold"),
        plain(
            f" ({view}): {len(info.messages)} message(s), "
            f"{len(info.compactions)} compaction(s){now}",
            "dim",
        ),
    )


def _raw(info: TranscriptInfo) -> list[RenderableType]:
    if not info.messages and not info.compactions:
        return [plain("no messages", "dim")]
    current = info.current
    at: dict[int, list[CompactionInfo]] = {}
    for c in info.compactions:
        at.setdefault(min(c.upto, len(info.messages)), []).append(c)
    parts: list[RenderableType] = []
    for i, m in enumerate(info.messages):
        parts.extend(marker(c, c is current) for c in at.get(i, []))
        parts.extend(message_view(m.message, str(m.position), m.step_id))
    parts.extend(marker(c, c is current) for c in at.get(len(info.messages), []))
    return parts


def _window(info: TranscriptInfo) -> list[RenderableType]:
    current = info.current
    if current is None or current.summary is None:
        note = "no compaction done: the model sees every message"
        return [plain(note, "dim"), *_raw_messages(info.messages)]
    parts: list[RenderableType] = [
        plain(
            f"── summary (compaction {current.number}, {current.step_id}): "
            f"stands for {covered(current.upto)} ──",
            "bold magenta",
        )
    ]
    for message in current.summary:
        parts.extend(message_view(message, "summary", current.step_id))
    after = messages_range(current.upto, len(info.messages))
    parts.append(plain(f"── after the summary: {after} ──", "dim"))
    parts.extend(_raw_messages(info.messages[current.upto :]))
    return parts


def _raw_messages(found: list[MessageInfo]) -> list[RenderableType]:
    parts: list[RenderableType] = []
    for m in found:
        parts.extend(message_view(m.message, str(m.position), m.step_id))
    return parts or [plain("no messages", "dim")]


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


def message_view(message: Any, position: str, step_id: str | None) -> list[RenderableType]:
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
    parts: list[RenderableType] = [head]
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
