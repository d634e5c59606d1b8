"""``fleet transcript`` as an operator meets it: a real run on a real worker, its
conversation read back through the command line in each view and as JSON; an unknown
run and two views at once are one line and exit 2. On the embedded default: what the
store keeps and reads back is tested on both stores in tests/integration/test_transcripts.py,
and each command here is a process of its own (seconds each on a busy machine)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

from fleet import Fleet
from tests import chat_flows
from tests.e2e.test_cli import fleet_cli, one_line_error
from tests.harness import Backend, Cluster

APP = "tests.chat_flows"
TURNS = 6


@pytest.fixture
def chat(backend: Backend) -> Iterator[Fleet]:
    fleet = chat_flows.fleet.with_settings(backend.settings())
    fleet.upgrade_schema()
    yield fleet
    fleet.runtime.db.dispose()


def _ok(backend: Backend, *args: str) -> str:
    out = fleet_cli(backend, "transcript", *args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr == "", out.stderr
    return out.stdout


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_runs_conversation_in_every_view(backend: Backend, chat: Fleet, cluster: Cluster) -> None:
    cluster.worker("w1", app=APP)
    run = chat.enqueue("chatty", TURNS, 2, run_id="chat-1")  # compacts every second turn
    length = run.wait(timeout=90)
    info = chat.transcript(run.id)
    assert len(info.messages) == length and len(info.compactions) == TURNS // 2
    current = info.current
    assert current is not None and current.number == TURNS // 2

    # --raw (the default): every message in order, who produced it, compactions marked.
    raw = _ok(backend, "chat-1", "-A", APP).splitlines()
    assert raw == _ok(backend, "chat-1", "--raw").splitlines()
    heads = [line for line in raw if line.startswith("#")]
    assert len(heads) == length
    assert heads[0] == "#0 user · workflow"
    assert heads[1] == "#1 assistant · respond#1"
    # Every second turn asks for lookup: the call under the reply, the result after it.
    assert "#3 assistant · respond#2" in heads
    assert '    → lookup({"q": 2}) [call-2]' in raw
    assert "#4 tool · call-2 for tool call call-2" in heads
    assert '    {"answer": 14}' in raw
    for c in info.compactions:
        line = (
            f"── compaction {c.number} (summarize#{c.number}): messages 0–{c.upto - 1} summarized"
        )
        line += ", current ──" if c is current else " ──"
        assert raw[raw.index(line) + 1].startswith(f"#{c.upto} "), (line, raw)

    # --window: the current summary, marked, then only the messages after it.
    window = _ok(backend, "chat-1", "--window").splitlines()
    assert window[1] == (
        f"── summary (compaction {current.number}, summarize#{current.number}): "
        f"stands for messages 0–{current.upto - 1} ──"
    )
    assert window[3].startswith("    summary: ")
    shown = [int(line.split()[0][1:]) for line in window if line.startswith("#")]
    assert shown == list(range(current.upto, length))

    # --json: valid JSON on stdout and nothing else, nothing clipped.
    doc = json.loads(_ok(backend, "chat-1", "--json"))
    assert (doc["run_id"], doc["name"], doc["view"]) == ("chat-1", "main", "raw")
    assert [m["message"] for m in doc["messages"]] == info.raw()
    assert [m["step_id"] for m in doc["messages"]][:2] == [None, "respond#1"]
    assert [(c["number"], c["status"], c["current"]) for c in doc["compactions"]] == [
        (1, "done", False),
        (2, "done", False),
        (3, "done", True),
    ]
    win = json.loads(_ok(backend, "chat-1", "--window", "--json"))
    assert win["view"] == "window" and win["compaction"] == current.number
    assert win["messages"] == info.window()
    assert win["messages"][0]["content"].startswith("summary: ")

    # --compactions: one row each, what it covers, its step and status, the current marked.
    table = _ok(backend, "chat-1", "--compactions").splitlines()
    rows = [[c.strip() for c in r.strip("│").split("│")] for r in table if r.startswith("│")]
    assert [(r[0], r[1], r[3], r[4], r[6]) for r in rows] == [
        (str(c.number), f"messages 0–{c.upto - 1}", c.step_id, "done", "current" * (c is current))
        for c in info.compactions
    ]
    assert all(r[5].startswith("summary: ") for r in rows)

    # A name the run never wrote to is an empty transcript, not an error.
    assert "no messages" in _ok(backend, "chat-1", "--name", "notes")
    assert json.loads(_ok(backend, "chat-1", "--name", "notes", "--json"))["messages"] == []


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["no-such-run"], ["unknown run id 'no-such-run'"]),
        (["no-such-run", "--json"], ["unknown run id 'no-such-run'"]),
        (["kept", "--raw", "--window"], ["at most one of", "--raw --window"]),
        (["kept", "--window", "--compactions"], ["at most one of"]),
        (["kept", "--name", "a#b"], ["transcript name 'a#b'"]),
    ],
)
def test_bad_usage_is_one_line_exit_2(
    backend: Backend, chat: Fleet, args: list[str], needles: list[str]
) -> None:
    chat.enqueue("chatty", 1, run_id="kept")
    out = fleet_cli(backend, "transcript", *args)
    one_line_error(out, *needles)
    assert out.stdout == ""


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_transcript_longer_than_a_page_is_printed_whole_as_it_is_read(
    backend: Backend, chat: Fleet
) -> None:
    """Issue 48, item 9: ``fleet transcript`` laid out every message before printing any
    (20,000 took 15.8 s, all in memory). It reads a page at a time and prints each as it
    goes: across pages the output is what the whole transcript renders to, markers
    where they were, and the JSON the same document."""
    from rich.console import Console

    from fleet.ops.cli_transcript import PAGE, Pages
    from fleet.ops.render_transcript import render_transcript, transcript_json
    from fleet.testing import InlineBroker

    length = 2 * PAGE + 203
    broker = InlineBroker(chat)
    run = chat.enqueue("long_chat", length, [PAGE + 2, 2 * PAGE + 1], run_id="long")
    broker.drain()
    assert run.wait(timeout=5) == length
    info = chat.transcript("long")
    assert [c.upto for c in info.compactions] == [PAGE, 2 * PAGE - 1]  # a page starts at one

    reads: list[tuple[int, int]] = []
    page = chat.runtime.queries.transcript_page

    def counted(run_id: str, name: str, start: int, limit: int) -> list[Any]:
        reads.append((start, limit))
        return page(run_id, name, start, limit)

    chat.runtime.queries.transcript_page = counted  # type: ignore[method-assign]
    first = next(Pages(chat, "long", "main").messages(0))
    assert first.position == 0 and reads == [(0, PAGE)], "one page read, the first message out"

    for view in ("raw", "window"):
        whole = Console(width=10_000, record=True, file=io.StringIO())
        whole.print(render_transcript(info, view=view), soft_wrap=True)
        expected = [line.rstrip() for line in whole.export_text().splitlines()]
        shown = _ok(backend, "long", f"--{view}", "-A", APP).splitlines()
        assert shown == expected
        doc = json.loads(_ok(backend, "long", f"--{view}", "--json", "-A", APP))
        assert doc == json.loads(json.dumps(transcript_json(info, view), default=repr))
