"""Transcripts without services: the cursor's record, the codec's marker (which user
data can never forge), the comparison of replayed appends, the read-only sequence and
the model's window, and a whole agent loop on the in-process broker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet import Fleet, RunFailed, Settings, StepContext, WorkflowContext, codec
from fleet.errors import PayloadError
from fleet.store.message_cache import EMPTY, NotJSON, fresh_copy
from fleet.testing import InlineBroker
from fleet.transcripts import (
    MARKER,
    CompactionInfo,
    Cursor,
    MessageInfo,
    Messages,
    TranscriptInfo,
    reading,
    summary_messages,
)
from fleet.worker import live
from tests.harness import same

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)


def test_a_cursor_round_trips_through_the_codec_as_a_marker() -> None:
    cursor = Cursor("run-1", "main", 3, 40, "summarize#2")
    text = codec.encode({"chat": cursor}, what="input", limit=1000)
    assert MARKER in text and len(text) < 120
    assert codec.decode(text) == {"chat": cursor}
    whole = Cursor("run-1", "main", 0, 40, window=(12, "summarize#1"))
    assert codec.decode(codec.encode([whole], what="x", limit=1000)) == [whole]
    assert whole.windowed() == Cursor("run-1", "main", 12, 40, "summarize#1")


@given(json_values)
def test_user_data_is_never_taken_for_a_cursor(value: Any) -> None:
    forged = {MARKER: {"run": "other-run", "name": "main", "end": 5}, "v": value}
    for candidate in (forged, {MARKER: forged[MARKER]}, [{MARKER: value}]):
        assert codec.decode(codec.encode(candidate, what="x", limit=1 << 20)) == candidate


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {"run": "r", "name": "main"},
        {"run": 1, "name": "m", "end": 1},
        {"run": "r", "name": "m", "end": 2, "start": 3},
        {"run": "r", "name": "m", "end": 2, "window": [5, "s"]},
        {"run": "r", "name": "m", "end": True},
    ],
)
def test_a_malformed_cursor_in_a_row_is_a_payload_error(body: Any) -> None:
    text = f'{{"{MARKER}": {codec.encode(body, what="x", limit=1000)}}}'
    with pytest.raises(PayloadError, match="transcript cursor is malformed"):
        codec.decode(text)


def test_a_cursor_decoded_inside_a_step_is_the_readers_view() -> None:
    class Reader:
        def view(self, cursor: Cursor) -> Any:
            return ("view of", cursor.name, cursor.end)

    text = codec.encode([Cursor("r", "main", 0, 7)], what="x", limit=1000)
    with reading(Reader()):
        assert codec.decode(text) == [("view of", "main", 7)]
    assert codec.decode(text) == [Cursor("r", "main", 0, 7)]


def test_same_keeps_json_types_apart_and_ignores_key_order() -> None:
    assert same({"a": 1, "b": [1, "x"]}, {"b": [1, "x"], "a": 1})
    assert same([1, 2], (1, 2))
    assert not same({"a": 1}, {"a": 1.0})
    assert not same({"a": 1}, {"a": True})
    assert not same({"a": [1]}, {"a": [1, 2]})
    assert not same({"a": 1}, {"a": 1, "b": None})


def test_summary_messages_takes_a_message_a_list_or_a_string() -> None:
    assert summary_messages("gist") == [{"role": "system", "content": "gist"}]
    assert summary_messages({"role": "user", "content": "x"}) == [{"role": "user", "content": "x"}]
    calls = {"role": "assistant", "tool_calls": [{"id": "a"}]}
    assert summary_messages([calls]) == [calls]
    with pytest.raises(PayloadError, match="returned int"):
        summary_messages(3)


@pytest.mark.parametrize(
    ("summary", "wrong"),
    [
        (
            {"not": "a message", "role": 42},
            "summary is not a message: its role must be a string, one of assistant, "
            "developer, function, system, tool, user (found int 42)",
        ),
        ([{"a": 1}], "summary message 0 is not a message: its role must be a string"),
        (
            [{"role": "system", "content": "x"}, {"role": "wizard", "content": "y"}],
            "summary message 1 is not a message: role 'wizard' is not one of",
        ),
        ({"role": "user"}, "summary is not a message: a user message needs a content"),
    ],
)
def test_a_summary_that_is_not_messages_is_refused_naming_what_is_wrong(
    summary: Any, wrong: str
) -> None:
    with pytest.raises(PayloadError) as refused:
        summary_messages(summary)
    assert str(refused.value).startswith("a compaction's " + wrong)
    assert "\n" not in str(refused.value)


def test_messages_is_a_read_only_sequence_that_loads_only_what_is_asked() -> None:
    asked: list[tuple[int, int]] = []
    data = [{"n": i} for i in range(10)]

    def load(a: int, b: int) -> list[dict[str, int]]:
        asked.append((a, b))
        return [dict(m) for m in data[a:b]]

    view = Messages(load, 10)
    assert len(view) == 10 and view[-1] == {"n": 9} and view[2:4] == [{"n": 2}, {"n": 3}]
    assert list(view) == data and view[8:100] == data[8:] and view[5:2] == []
    assert asked == [(9, 10), (2, 4), (0, 10), (8, 10)]
    with pytest.raises(IndexError):
        view[10]
    view[0]["n"] = 99  # the caller's own copy
    assert view[0] == {"n": 0}


def test_a_transcripts_window_is_the_current_summary_then_what_follows() -> None:
    msgs = [MessageInfo(i, {"content": str(i)}, None, 0.0) for i in range(6)]
    done = CompactionInfo(1, 0, 4, None, "s#1", "done", [{"content": "gist"}], 0.0)
    running = CompactionInfo(2, 4, 5, 1, "s#2", "running", None, 0.0)
    info = TranscriptInfo("r", "main", msgs, [done, running])
    assert info.current == done
    assert info.window() == [{"content": "gist"}, {"content": "4"}, {"content": "5"}]
    assert TranscriptInfo("r", "main", msgs, []).window() == info.raw()


app = Fleet("unit-chat", settings=Settings(broker_url="redis://127.0.0.1:1/0"))


@app.step
def turn(ctx: StepContext, chat: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": f"{len(chat)} seen, first {chat[0]['content']}"}


@app.workflow(pins={"model": "m-1"})
def loop(wf: WorkflowContext, n: int) -> list[int]:
    chat = wf.transcript()
    chat.append({"role": "user", "content": "hi"})
    for _ in range(n):
        chat.append(wf.step(turn, chat))
    other = wf.transcript("notes")
    other.append({"role": "user", "content": "a second transcript"})
    return [len(chat), len(other)]


def _inline(tmp_path: Path) -> tuple[Fleet, InlineBroker]:
    """The test app on a SQLite store in ``tmp_path``, its messages run in process."""
    fleet = app.with_settings(
        Settings(database_url=f"sqlite:///{tmp_path}/a.db", broker_url=app.settings.broker_url)
    )
    return fleet, InlineBroker(fleet)


def test_an_agent_loop_on_the_inline_broker(tmp_path: Path) -> None:
    fleet, broker = _inline(tmp_path)
    run = fleet.enqueue("loop", 3)
    broker.drain()
    assert run.wait(timeout=0) == [4, 1]
    raw = fleet.transcript(run.id).raw()
    assert [m["content"] for m in raw] == [
        "hi",
        "1 seen, first hi",
        "2 seen, first hi",
        "3 seen, first hi",
    ]
    assert fleet.transcript(run.id, "notes").raw() == [
        {"role": "user", "content": "a second transcript"}
    ]
    assert fleet.transcript(run.id, "never").messages == []


@app.step
def big(ctx: StepContext, chat: Any) -> int:
    return sum(len(m["content"]) for m in chat.window())


@app.workflow
def oversized(wf: WorkflowContext, size: int) -> int:
    chat = wf.transcript()
    chat.append({"role": "user", "content": "small"})
    chat.append({"role": "user", "content": "x" * size})
    return wf.step(big, chat)


def test_a_large_message_goes_by_reference_and_an_oversize_one_fails_the_run_in_one_line(
    tmp_path: Path,
) -> None:
    fleet = app.with_settings(
        Settings(
            database_url=f"sqlite:///{tmp_path}/a.db",
            broker_url=app.settings.broker_url,
            max_payload_bytes=1000,
            max_blob_bytes=5000,
        )
    )
    broker = InlineBroker(fleet)
    ok = fleet.enqueue("oversized", 3000)  # over the inline limit: a blob
    broker.drain()
    assert ok.wait(timeout=0) == 3005
    assert fleet.transcript(ok.id).raw()[1]["content"] == "x" * 3000
    bad = fleet.enqueue("oversized", 6000)
    broker.drain()
    with pytest.raises(RunFailed) as failed:
        bad.wait(timeout=0)
    error = str(failed.value)
    assert "PayloadError: message 1 of transcript 'main' is" in error
    assert "over the 5000-byte payload limit" in error and "\n" not in error
    # What was appended before the oversize message is kept.
    assert fleet.transcript(bad.id).raw() == [{"role": "user", "content": "small"}]


@app.step
def count(ctx: StepContext, messages: Any) -> str:
    return f"{len(messages)} messages"


@app.step
def not_a_summary(ctx: StepContext, messages: Any) -> dict[str, Any]:
    return {"not": "a message", "role": 42}


@app.workflow
def compacts_badly(wf: WorkflowContext) -> list[Any]:
    chat = wf.transcript()
    chat.append({"role": "user", "content": "go"})
    chat.append({"role": "assistant", "content": "went"})
    return wf.compact(chat, not_a_summary, keep_last=1)


def test_a_compaction_whose_summary_is_not_a_message_fails_the_run_in_one_line(
    tmp_path: Path,
) -> None:
    fleet, broker = _inline(tmp_path)
    run = fleet.enqueue("compacts_badly")
    broker.drain()
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=0)
    error = str(failed.value)
    assert "PayloadError: a compaction's summary is not a message: its role must be" in error
    assert "(found int 42)" in error and "\n" not in error
    # Nothing recorded is lost: the raw messages stay.
    assert [m["content"] for m in fleet.transcript(run.id).raw()] == ["go", "went"]


@app.workflow
def toolish(wf: WorkflowContext) -> list[Any]:
    chat = wf.transcript()
    chat.append({"role": "user", "content": "go"})
    chat.append({"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]})
    chat.append({"role": "tool", "tool_call_id": "a", "content": "1"})
    chat.append({"role": "tool", "tool_call_id": "b", "content": "2"})
    chat.append({"role": "assistant", "content": "done"})
    return [wf.compact(chat, count, keep_last=2), [m["role"] for m in chat.window()]]


def test_a_compaction_never_keeps_a_tool_result_without_its_call(tmp_path: Path) -> None:
    fleet, broker = _inline(tmp_path)
    run = fleet.enqueue("toolish")
    broker.drain()
    summary, roles = run.wait(timeout=0)
    assert summary == [{"role": "system", "content": "1 messages"}]
    assert roles == ["system", "assistant", "tool", "tool", "assistant"]
    assert [c.upto for c in fleet.transcript(run.id).compactions] == [1]


def test_a_held_output_is_a_structural_copy_sharing_only_immutable_leaves() -> None:
    value = codec.decode('{"a": "x", "b": [1, {"c": 2.5, "d": null, "e": true}]}')
    copy = fresh_copy(value)
    assert same(copy, value) and copy is not value
    assert copy["b"] is not value["b"] and copy["b"][1] is not value["b"][1]
    assert copy["a"] is value["a"]  # a string is shared: it cannot be changed
    with pytest.raises(NotJSON):  # anything but JSON: its text is decoded afresh
        fresh_copy({"chat": Cursor("r", "main", 0, 1)})
    grown = EMPTY.grown(['{"a":1}', '{"b":2}'], [None, "s#1"]).grown(["{}"], ["s#2"])
    assert grown.outputs == {"s#1": 1, "s#2": 2} and len(grown) == 3
    assert grown.fresh(1) == {"b": 2} and grown.fresh(1) is not grown.values[1]
    text = codec.encode({"chat": Cursor("r", "main", 0, 1)}, what="m", limit=1000)
    holder = EMPTY.grown([text])
    assert holder.fresh(0) == holder.values[0] and holder.fresh(0) is not holder.values[0]


@app.step
def answer(ctx: StepContext, chat: Any, n: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"answer {n}", "meta": {"tags": ["a"]}}


@app.workflow
def annotating(wf: WorkflowContext, n: int) -> list[Any]:
    """Changes each reply (its nested list too) once it is appended: the workflow's
    own copy, never what a later replay is handed."""
    chat = wf.transcript()
    chat.append({"role": "user", "content": "q"})
    for i in range(n):
        reply = wf.step(answer, chat, i)
        chat.append(reply)
        reply["meta"]["tags"].append("seen")
        reply["content"] += " (read)"
    return [m.get("meta") for m in chat]


def test_a_replay_hands_out_copies_of_recorded_replies_never_the_cache(tmp_path: Path) -> None:
    fleet, broker = _inline(tmp_path)
    run = fleet.enqueue("annotating", 4)
    broker.drain()
    # Replayed five times; each reply's tags changed once, by the last replay only.
    assert run.wait(timeout=0) == [None] + [{"tags": ["a", "seen"]}] * 4
    row = fleet.runtime.queries.run(run.id)
    assert row is not None
    recorded = fleet.runtime.queries.recorded(run.id, row.created_at, "main")
    assert recorded.outputs == {f"answer#{i}": i for i in range(1, 5)}
    # The cached values are still what was recorded: no replay changed them.
    assert [codec.decode(t) for t in recorded.texts] == list(recorded.values)
    assert fleet.transcript(run.id).raw()[1] == {
        "role": "assistant",
        "content": "answer 0",
        "meta": {"tags": ["a"]},
    }


EDIT: dict[str, Any] = {"tag": None}


@app.workflow
def edited(wf: WorkflowContext) -> int:
    chat = wf.transcript()
    chat.append({"role": "user", "content": "q"})
    reply = wf.step(answer, chat, 0)
    if EDIT["tag"]:
        reply["meta"]["tags"].append(EDIT["tag"])  # a code change, deep in the reply
    chat.append(reply)
    wf.wait_for("go")
    return len(chat)


def test_a_reply_changed_before_its_append_on_replay_is_non_determinism(tmp_path: Path) -> None:
    fleet, broker = _inline(tmp_path)
    run = fleet.enqueue("edited")
    broker.drain()
    assert run.status() == "waiting"
    EDIT["tag"] = "new"
    live.RUNS.clear()  # a code change is a new process: it keeps no parked workflow
    try:
        fleet.signal(run.id, "go", True)
        broker.drain()
    finally:
        EDIT["tag"] = None
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=0)
    error = str(failed.value)
    assert "NonDeterminism" in error and "message 1 of transcript 'main'" in error, error
    assert '"tags":["a","new"]' in error
