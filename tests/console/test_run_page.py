"""A run's page, on SQLite and Postgres: steps by id, a transcript given to a step shown
as a reference, tool calls as ``fleet transcript`` writes them, effects' intents, the
app's name; the transcript paged newest first and kept out of the live region."""

from __future__ import annotations

from fleet import Fleet
from fleet.console.run_page import live_region
from fleet.console.transcript_view import PAGE
from tests.console.conftest import Web, error_line
from tests.console.dom import Node, parse
from tests.harness import InlineBroker

HOSTILE = "<script>alert(1)</script>[bold]"


def test_run_page_shows_its_transcript_and_what_the_model_sees(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("talks", text=HOSTILE, run_id="chat")
    inline.drain()
    response = web.http.get("/runs/chat")
    assert "<script>alert" not in response.text
    section = parse(response.text).by_id("transcript").one("section", data_name="main")
    (raw,) = [ol for ol in section.all("ol", class_="messages") if "reversed" in ol.attrs]
    listed = raw.all("li", class_="message")
    assert [li.one("b").text for li in listed] == ["assistant", "user"], "newest first"
    assert [li.get("value") for li in listed] == ["1", "0"]
    assert HOSTILE in listed[1].text
    summary = section.one("details", class_="summary")
    assert "compaction 1 (gist#1)" in summary.one("summary").text
    assert "gist: " in summary.text, "what the model sees starts with the summary"


def _messages(doc: Node) -> list[str]:
    """The positions listed, and "marker" where a compaction's line is, in order."""
    found = []
    for li in doc.all("li"):
        if li.get("class") == "marker":
            found.append("marker")
        elif li.get("value") is not None:
            found.append(li.get("value") or "")
    return found


def test_a_long_transcript_is_paged_newest_first_out_of_the_live_region(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    """Issue 48, item 9: a run page carried its whole transcript (20,000 messages: a
    5.6 MB page) and every live update sent it again."""
    client.enqueue("tool_agent", 120, 60, run_id="long")  # 126 messages, compacted to 60
    client.enqueue("tool_agent", 600, 60, run_id="longer")  # 606 messages
    inline.drain()
    assert client.run("long").status() == client.run("longer").status() == "succeeded"
    first = web.http.get("/runs/long")
    doc = parse(first.text)
    section = doc.by_id("transcript").one("section", data_name="main")
    assert "126 message(s), 1 compaction(s)" in section.one("h3").text
    assert _messages(section) == [str(p) for p in range(125, 125 - PAGE, -1)]
    more = section.one("li", class_="more").one("a")
    href = more.get("href") or ""
    assert more.get("hx-get") == href and href.endswith("before=76")
    # The next page, as htmx asks for it: list items in place of the link.
    second = web.http.get(href, headers={"HX-Request": "true"})
    assert second.status_code == 200 and not second.text.lstrip().startswith("<!doctype")
    page2 = parse(second.text)
    positions = [str(p) for p in range(75, 25, -1)]
    i = positions.index("59")  # the compaction summarized 0-59: its line above 59
    assert _messages(page2) == positions[:i] + ["marker"] + positions[i:]
    assert (
        "compaction 1 (gist#1): messages 0–59 summarized" in page2.one("li", class_="marker").text
    )
    last_href = page2.one("li", class_="more").one("a").get("href") or ""
    # Without htmx, a page of its own; the oldest page has no link further.
    last = web.page(last_href)
    assert last.one("h1").text == "Transcript main of long"
    assert _messages(last) == [str(p) for p in range(25, -1, -1)]
    assert not last.has("li", class_="more")
    # What a page costs does not grow with the transcript: 606 messages, about the same.
    longer = web.http.get("/runs/longer")
    assert "606 message(s)" in longer.text
    assert len(longer.text) < 1.05 * len(first.text), (len(longer.text), len(first.text))
    # The live region carries no transcript.
    region = live_region(web.app.state.console, "long", "")
    assert "note 119" not in region and 'id="transcript"' not in region
    assert "note 119" in first.text


def test_older_messages_refuse_bad_input_in_one_line(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("talks", run_id="chat")
    inline.drain()
    for query, status, words in (
        ("run=chat&name=main&before=-1", 400, "before must be between 0 and"),
        ("run=chat&name=main&before=x", 400, "before must be a whole number"),
        ("run=chat&name=main&before=99999999999", 400, "before must be between 0 and"),
        ("run=chat&name=main", 400, "before must be a whole number"),
        ("run=chat&name=&before=1", 400, "transcript name '' must be"),
        ("run=ghost&name=main&before=1", 404, "unknown run 'ghost'"),
    ):
        response = web.http.get(f"/transcripts?{query}")
        assert response.status_code == status, (query, response.text[-500:])
        assert words in error_line(response), (query, error_line(response))
    empty = web.page("/transcripts?run=chat&name=other&before=5")
    assert _messages(empty) == []


def test_run_page_names_steps_by_id_and_reads_as_the_cli_does(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    """Issue 48, item 19: steps were listed by function name (model_turn three times), a
    model step's input showed the cursor's marker, tool calls were raw JSON, there was
    no effects table, and the title said "fleet", not the app."""
    client.enqueue("tool_agent", run_id="agent")
    inline.drain()
    assert client.run("agent").status() == "succeeded"
    response = web.http.get("/runs/agent")
    assert "$fleet_transcript" not in response.text
    doc = parse(response.text)
    assert doc.one("title").text == "agent · testflows · fleet console"
    assert doc.by_id("app").text == "testflows"
    steps = doc.by_id("steps")
    shown = [r.one("td", class_="step-id").text for r in steps.all("tr") if r.get("data-step-id")]
    assert shown == [
        "model_turn#1",
        "call_read_0 read_note",
        "model_turn#2",
        "call_read_1 read_note",
        "model_turn#3",
        "file_report#1",
    ]
    first = steps.one("tr", data_step_id="model_turn#1").one("td", class_="input").text
    assert first == '{"args": [⟨transcript main: message 0⟩, 0], "kwargs": {}}'
    third = steps.one("tr", data_step_id="model_turn#3").one("td", class_="input").text
    assert "⟨transcript main: messages 0–4⟩, 2]" in third
    calls = [c.text for c in doc.by_id("transcript").all("div", class_="tool-call")]
    assert calls == [
        '→ read_note({"path": "notes/1.md"}) [call_read_1]',
        '→ read_note({"path": "notes/0.md"}) [call_read_0]',
    ]
    tool = doc.by_id("transcript").one("li", value="2")
    assert "for tool call call_read_0" in tool.text and "contents of notes/0.md" in tool.text
    effect = doc.by_id("effects").one("tr", data_key="agent:file_report#1")
    assert [td.text for td in effect.all("td")][:3] == ["file_report#1", "1", "agent:file_report#1"]
    assert effect.one("td", class_="outcome").text == "done"
    assert parse(web.http.get("/runs").text).one("title").text == "testflows · fleet console"
