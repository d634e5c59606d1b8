"""A run's transcripts on its page, paged: the newest ``PAGE`` messages of each, newest
first, and older ones a page at a time ("load older messages", GET ``/transcripts``);
where the model's view begins, the current compaction marked and its summary shown.
And how a step's input that holds a transcript is shown: a reference to it, never
the cursor's marker.

The rule: a run page costs the same at 20 and at 20,000 messages. Every read is a
bounded index range (``Browse.transcript_names``, ``Browse.transcript_page``), and
transcripts stay out of the run's live region (``run_page``), which its watcher
renders again at every change. A message reads as ``fleet transcript`` prints it:
role, producing step, content, one ``→ name(args) [id]`` line per tool call
(``fleet.transcripts.tool_call_line``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from fleet import codec
from fleet.bounds import INT32, whole
from fleet.console.render import HEADERS, Console, Refused, clip, page, root, stored
from fleet.errors import PayloadError
from fleet.registry import check_name
from fleet.store.browse import TranscriptPage
from fleet.transcripts import MARKER, Cursor, summary_messages, tool_call_line

PAGE = 50  # messages a transcript shows at first, and loads at a time
NAMES = 20  # transcripts a run page shows


@dataclass
class MessageView:
    """One message as a person reads it."""

    position: str
    role: str
    step_id: str | None
    content: str | None = None
    calls: list[str] = field(default_factory=list)
    name: str | None = None
    tool_call_id: str | None = None
    marker: str | None = None  # set: not a message, the line where a compaction begins


@dataclass
class TranscriptView:
    """A page of one transcript: ``items`` newest first, ``before`` the position older
    messages are loaded from (None: none are left)."""

    run_id: str
    name: str
    length: int
    compactions: int
    items: list[MessageView]
    before: int | None
    current: dict[str, Any] | None = None

    def more_href(self, base: str) -> str:
        query = urlencode({"run": self.run_id, "name": self.name, "before": self.before})
        return f"{base}/transcripts?{query}"


def message_view(message: Any, position: str, step_id: str | None) -> MessageView:
    if not isinstance(message, dict):
        return MessageView(position, "?", step_id, json.dumps(message, default=repr))
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        content = json.dumps(content, default=repr, ensure_ascii=False)
    calls = message.get("tool_calls")
    lines = [tool_call_line(c) for c in calls] if isinstance(calls, list) else []
    if calls is not None and not isinstance(calls, list):
        lines = [tool_call_line(calls)]
    return MessageView(
        position,
        str(message.get("role", "?")),
        step_id,
        content or None,
        lines,
        None if message.get("name") is None else str(message["name"]),
        None if message.get("tool_call_id") is None else str(message["tool_call_id"]),
    )


def _decoded(body: str) -> Any:
    try:
        return codec.decode(body)
    except PayloadError as exc:
        return {"role": "?", "content": f"(this message cannot be read: {exc})"}


def view(c: Console, run_id: str, name: str, before: int | None = None) -> TranscriptView:
    """A page of transcript ``name``: ``PAGE`` messages before ``before``, newest first,
    the current compaction's marker among them where its summary begins."""
    found: TranscriptPage = c.browse.transcript_page(run_id, name, before, PAGE)
    current = None
    if found.current is not None:
        number, _start, upto, _base, step_id, _status, output, _at = found.current
        try:
            summary = summary_messages(c.fleet.runtime.payloads.load(output))
        except PayloadError as exc:
            summary = [{"role": "system", "content": f"(the summary cannot be read: {exc})"}]
        current = {
            "number": number,
            "upto": upto,
            "step_id": step_id,
            "summary": [message_view(m, "summary", step_id) for m in summary],
        }
    items = []
    for pos, body, step_id, _at in found.messages:
        if current is not None and pos == current["upto"] - 1:
            line = f"compaction {current['number']} ({current['step_id']}): messages "
            line += f"0–{pos} summarized; the model sees its summary, then what is above"
            items.append(MessageView("", "", None, marker=line))
        items.append(message_view(_decoded(body), str(pos), step_id))
    oldest = found.messages[-1][0] if found.messages else 0
    return TranscriptView(
        run_id, name, found.length, found.compactions, items, oldest or None, current
    )


def transcripts(c: Console, run_id: str) -> list[TranscriptView]:
    """The first page of each of the run's transcripts (the first ``NAMES`` of them)."""
    return [view(c, run_id, name) for name in c.browse.transcript_names(run_id, NAMES)]


def more(c: Console, request: Request) -> Response:
    """``/transcripts?run=ID&name=NAME&before=POS``: the page of older messages, as
    list items for htmx to put in place of the link, or as a page of its own."""
    params = request.query_params
    run_id, name = params.get("run", ""), params.get("name", "")
    check_name(name, "transcript")
    before = whole(params.get("before", ""), "before", low=0, high=INT32)
    if c.fleet.runtime.queries.run(run_id) is None:
        raise Refused(404, f"unknown run '{run_id}'")
    found = view(c, run_id, name, before)
    if request.headers.get("hx-request") == "true":
        html = c.fragment("transcript_items.html", t=found, root=root(request))
        return HTMLResponse(html, headers=HEADERS)
    return page(c, request, "transcript.html", t=found, title=f"transcript {name} of {run_id}")


# --- a step's input ------------------------------------------------------------------


def reference(cursor: Cursor) -> str:
    """A transcript given to a step, as the page names it."""
    n = cursor.end - cursor.start
    span = "no messages" if n <= 0 else f"message {cursor.start}"
    if n > 1:
        span = f"messages {cursor.start}–{cursor.end - 1}"
    led = f", after the summary of {cursor.summary}" if cursor.summary else ""
    if cursor.window is not None:
        upto, step_id = cursor.window
        led += f"; the model's view: the summary of {step_id}, then from {upto} on"
    return f"⟨transcript {cursor.name}: {span}{led}⟩"


def shown_input(text: str | None) -> str:
    """A step's recorded input as its row shows it (``render.stored``), a transcript it
    was given shown as a reference (``reference``), not as the cursor's marker."""
    if text is None or text.startswith("blob:") or f'"{MARKER}"' not in text:
        return stored(text)
    try:
        value = codec.decode(text)
    except PayloadError:
        return stored(text)
    refs: list[str] = []

    def token(v: Any) -> str:
        if not isinstance(v, Cursor):
            return repr(v)
        refs.append(reference(v))
        return f"@@fleet-ref-{len(refs) - 1}@@"

    shown = json.dumps(value, default=token, ensure_ascii=False)
    for i, ref in enumerate(refs):
        shown = shown.replace(f'"@@fleet-ref-{i}@@"', ref)
    return clip(shown)
