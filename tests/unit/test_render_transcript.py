"""``fleet transcript``'s views, over transcripts built by hand: every message in order
with its position, role, producing step and tool calls; compactions marked where their
summary begins; the model's window; the compactions table; the JSON form, never
clipped; and stored values shown as text, never as Rich markup."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from rich.console import Console, Group, RenderableType

from fleet.errors import BadInput
from fleet.ops.cli_transcript import pick_view
from fleet.ops.render_transcript import (
    CLIP,
    render_compactions,
    render_transcript,
    tool_call_line,
    transcript_json,
    transcript_json_text,
    transcript_lines,
)
from fleet.transcripts import CompactionInfo, MessageInfo, TranscriptInfo


def show(renderable: RenderableType) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None, emoji=False).print(renderable)
    return out.getvalue()


def lines(renderable: RenderableType) -> list[str]:
    return [line.rstrip() for line in show(renderable).splitlines()]


OPENAI_CALL = {
    "id": "call_a",
    "type": "function",
    "function": {"name": "search", "arguments": '{"q": "fleet", "n": 3}'},
}
SIMPLE_CALL = {"id": "call_b", "name": "lookup", "args": {"q": 2}}


def _messages() -> list[MessageInfo]:
    bodies: list[tuple[dict[str, Any], str | None]] = [
        ({"role": "system", "content": "be brief"}, None),
        ({"role": "user", "content": "find fleet"}, None),
        (
            {"role": "assistant", "content": "looking", "tool_calls": [OPENAI_CALL, SIMPLE_CALL]},
            "respond#1",
        ),
        ({"role": "tool", "tool_call_id": "call_a", "content": "found 3"}, "call_a"),
        ({"role": "tool", "tool_call_id": "call_b", "content": "14"}, "call_b"),
        ({"role": "assistant", "content": "done: 3 results"}, "respond#2"),
        ({"role": "user", "content": "thanks"}, None),
    ]
    return [MessageInfo(i, m, step, 1000.0 + i) for i, (m, step) in enumerate(bodies)]


def _compaction(
    number: int, upto: int, status: str = "done", start: int = 0, base: int | None = None
) -> CompactionInfo:
    summary = (
        [{"role": "system", "content": f"summary {number}: first line\nsecond line"}]
        if status == "done"
        else None
    )
    return CompactionInfo(number, start, upto, base, f"summarize#{number}", status, summary, 2000.0)


def _info(
    *compactions: CompactionInfo, messages: list[MessageInfo] | None = None
) -> TranscriptInfo:
    found = _messages() if messages is None else messages
    return TranscriptInfo("run-1", "main", found, list(compactions))


def test_raw_shows_every_message_in_order_with_role_step_and_tool_calls() -> None:
    out = lines(render_transcript(_info()))
    heads = [line for line in out if line.startswith("#")]
    assert heads == [
        "#0 system · workflow",
        "#1 user · workflow",
        "#2 assistant · respond#1",
        "#3 tool · call_a for tool call call_a",
        "#4 tool · call_b for tool call call_b",
        "#5 assistant · respond#2",
        "#6 user · workflow",
    ]
    at = out.index("#2 assistant · respond#1")
    # Content, then both forms of tool call, one line each, indented under their message.
    assert out[at + 1 : at + 4] == [
        "    looking",
        '    → search({"q": "fleet", "n": 3}) [call_a]',
        '    → lookup({"q": 2}) [call_b]',
    ]
    assert "    found 3" in out and "    thanks" in out


def test_a_done_compaction_is_marked_before_the_first_message_it_does_not_cover() -> None:
    out = lines(render_transcript(_info(_compaction(1, 3), _compaction(2, 5, start=3, base=1))))
    first = "── compaction 1 (summarize#1): messages 0–2 summarized ──"
    second = "── compaction 2 (summarize#2): messages 0–4 summarized, current ──"
    assert out.index(first) == out.index("#3 tool · call_a for tool call call_a") - 1
    assert out.index(second) == out.index("#5 assistant · respond#2") - 1
    # Raw is raw: every message still shown, the summaries are not.
    assert sum(line.startswith("#") for line in out) == 7
    assert not any("summary 1: first line" in line for line in out)


def test_compactions_not_done_are_marked_as_such_and_never_current() -> None:
    info = _info(_compaction(1, 2), _compaction(2, 7, status="running", start=2, base=1))
    out = lines(render_transcript(info))
    assert "── compaction 1 (summarize#1): messages 0–1 summarized, current ──" in out
    # Covering every message: drawn after the last one.
    assert out[-1] == "── compaction 2 (summarize#2): messages 0–6, summary running ──"


def test_two_compactions_up_to_the_same_message_are_both_marked() -> None:
    out = lines(render_transcript(_info(_compaction(1, 4), _compaction(2, 4))))
    at = out.index("#4 tool · call_b for tool call call_b")
    assert out[at - 2 : at] == [
        "── compaction 1 (summarize#1): messages 0–3 summarized ──",
        "── compaction 2 (summarize#2): messages 0–3 summarized, current ──",
    ]


def test_the_window_is_the_current_summary_then_the_messages_after_it() -> None:
    info = _info(_compaction(1, 3), _compaction(2, 5, start=3, base=1))
    out = lines(render_transcript(info, view="window"))
    assert out[1:5] == [
        "── summary (compaction 2, summarize#2): stands for messages 0–4 ──",
        "summary system · summarize#2",
        "    summary 2: first line",
        "    second line",
    ]
    assert out[5] == "── after the summary: messages 5–6 ──"
    assert [line for line in out if line.startswith("#")] == [
        "#5 assistant · respond#2",
        "#6 user · workflow",
    ]
    assert not any("summary 1" in line for line in out)


def test_without_a_done_compaction_the_window_is_every_message() -> None:
    info = _info(_compaction(1, 3, status="failed"))
    out = lines(render_transcript(info, view="window"))
    assert "no compaction done: the model sees every message" in out
    assert sum(line.startswith("#") for line in out) == 7


def test_long_content_is_clipped_in_the_view_and_whole_in_json() -> None:
    long = "x" * (CLIP + 123)
    info = _info(messages=[MessageInfo(0, {"role": "user", "content": long}, None, 1.0)])
    text = show(render_transcript(info))
    assert "… (123 more chars)" in text
    assert "x" * (CLIP + 1) not in text.replace("\n", "").replace(" ", "")
    doc = json.loads(json.dumps(transcript_json(info, "raw")))
    assert doc["messages"][0]["message"]["content"] == long


def test_stored_values_print_literally_never_as_markup() -> None:
    hostile = "[bold]loud[/bold] [link=http://evil]click[/link] [/] \x1b[31mred"
    message = {
        "role": "user[red]",
        "content": hostile,
        "tool_calls": [{"id": "[/]", "name": "[bold]tool", "args": {"a": "[i]"}}],
    }
    info = TranscriptInfo(
        "run-[b]", "[i]chat", [MessageInfo(0, message, "step[/]#1", 1.0)], [_compaction(1, 1)]
    )
    text = show(render_transcript(info)) + show(render_compactions(info))
    assert "[bold]loud[/bold] [link=http://evil]click[/link] [/] \\x1b[31mred" in text
    assert "\x1b" not in text
    assert "#0 user[red] · step[/]#1" in text
    assert '→ [bold]tool({"a": "[i]"}) [[/]]' in text
    assert "transcript [i]chat of run run-[b]" in text


def test_tool_calls_in_either_form_and_malformed_ones_still_show() -> None:
    assert tool_call_line(OPENAI_CALL) == '→ search({"q": "fleet", "n": 3}) [call_a]'
    assert tool_call_line(SIMPLE_CALL) == '→ lookup({"q": 2}) [call_b]'
    broken = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    assert tool_call_line(broken) == "→ f({oops) [c]"
    assert tool_call_line({"odd": 1}) == '→ {"odd": 1}'
    assert tool_call_line("just text") == '→ "just text"'


def test_the_compactions_table_names_range_step_status_summary_and_current() -> None:
    info = _info(
        _compaction(1, 3),
        _compaction(2, 5, start=3, base=1),
        _compaction(3, 6, status="running", start=5, base=2),
    )
    rows = [line for line in lines(render_compactions(info)) if line.startswith("│")]
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    assert cells == [
        ["1", "messages 0–2", "raw 0–2", "summarize#1", "done", "summary 1: first line", ""],
        [
            "2",
            "messages 0–4",
            "summary 1 + raw 3–4",
            "summarize#2",
            "done",
            "summary 2: first line",
            "current",
        ],
        ["3", "messages 0–5", "summary 2 + raw 5", "summarize#3", "running", "", ""],
    ]


def test_the_json_forms() -> None:
    info = _info(_compaction(1, 3), _compaction(2, 5, start=3, base=1))
    raw = json.loads(json.dumps(transcript_json(info, "raw")))
    assert (raw["run_id"], raw["name"], raw["view"]) == ("run-1", "main", "raw")
    assert raw["messages"][2] == {
        "position": 2,
        "step_id": "respond#1",
        "at": 1002.0,
        "message": _messages()[2].message,
    }
    assert [c["current"] for c in raw["compactions"]] == [False, True]
    assert raw["compactions"][1]["summary"] == info.compactions[1].summary
    window = json.loads(json.dumps(transcript_json(info, "window")))
    assert window["view"] == "window" and window["compaction"] == 2
    assert window["messages"] == info.window()
    assert window["messages"][0]["content"].startswith("summary 2")
    only = transcript_json(info, "compactions")
    assert "messages" not in only and len(only["compactions"]) == 2


def test_an_empty_transcript() -> None:
    info = TranscriptInfo("run-1", "notes", [], [])
    assert "no messages" in show(render_transcript(info))
    assert "no messages" in show(render_transcript(info, view="window"))
    assert "no compactions" in show(render_compactions(info))
    assert transcript_json(info, "raw")["messages"] == []
    assert transcript_json(info, "window")["messages"] == []


def test_one_view_at_a_time() -> None:
    assert pick_view(raw=False, window=False, compactions=False) == "raw"
    assert pick_view(raw=False, window=True, compactions=False) == "window"
    with pytest.raises(BadInput, match="at most one of"):
        pick_view(raw=True, window=True, compactions=False)
    with pytest.raises(ValueError, match="unknown transcript view"):
        render_transcript(_info(), view="cooked")


@pytest.mark.parametrize(
    "info",
    [
        _info(),
        _info(_compaction(1, 3), _compaction(2, 5, start=3, base=1)),
        _info(_compaction(1, 4), _compaction(2, 9, status="failed")),  # past the last message
        _info(messages=[]),
    ],
)
def test_a_view_made_as_its_messages_are_read_is_the_whole_view(info: TranscriptInfo) -> None:
    """``fleet transcript`` prints a long transcript page by page (issue 48, item 9): its
    lines and its JSON, made from the messages handed over from a position on, are those
    of the whole transcript, compaction markers included."""
    head = TranscriptInfo(info.run_id, info.name, [], info.compactions)
    handed: list[int] = []

    def messages(start: int) -> Any:
        handed.append(start)
        return iter(info.messages[start:])

    for view in ("raw", "window"):
        made = list(transcript_lines(head, len(info.messages), view, messages))
        assert lines(Group(*made)) == lines(render_transcript(info, view=view))
        text = "".join(transcript_json_text(head, view, messages))
        assert json.loads(text) == json.loads(json.dumps(transcript_json(info, view), default=repr))
    current = info.current
    assert handed == [0, 0, 0, 0] if current is None else [0, current.upto, 0, current.upto]
