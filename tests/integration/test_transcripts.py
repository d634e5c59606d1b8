"""Invariant 10: raw history is immutable. Transcripts on real workers over both
backends: messages recorded once and checked on replay, steps given a cursor,
compactions recorded beside the raw messages and superseded, never destructive."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select

from fleet import Fleet, RunFailed
from fleet.store.messages import SAME_AS_OUTPUT
from fleet.store.schema import messages, steps
from tests import chat_flows
from tests.harness import Backend, Cluster, executions, poll

APP = "tests.chat_flows"


@pytest.fixture
def chat(backend: Backend) -> Iterator[Fleet]:
    fleet = chat_flows.fleet.with_settings(backend.settings())
    fleet.upgrade_schema()
    yield fleet
    fleet.runtime.db.dispose()


def _expected_chatty(turns: int) -> list[dict[str, object]]:
    """The raw transcript ``chatty(turns)`` must record, worked out by hand."""
    out: list[dict[str, object]] = [{"role": "user", "content": "start"}]
    for turn in range(1, turns + 1):
        seen = len(out)
        reply: dict[str, object] = {
            "role": "assistant",
            "content": f"turn {turn}: I saw {seen} messages, the last from {out[-1]['role']}",
        }
        if turn % 2 == 0:
            reply["tool_calls"] = [{"id": f"call-{turn}", "name": "lookup", "args": {"q": turn}}]
        out.append(reply)
        if turn % 2 == 0:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": f"call-{turn}",
                    "content": json.dumps({"answer": turn * 7}),
                }
            )
        out.append({"role": "user", "content": f"go on after turn {turn}"})
    return out


def test_a_transcript_is_recorded_once_and_steps_get_a_cursor(
    backend: Backend, chat: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", app=APP)
    run = chat.enqueue("chatty", 6)
    assert run.wait(timeout=60) == len(_expected_chatty(6))
    info = chat.transcript(run.id)
    assert info.raw() == _expected_chatty(6)
    # Each message is the output of the step that produced it, or the workflow's own.
    producers = {m.position: m.step_id for m in info.messages}
    assert producers[0] is None and producers[1] == "respond#1"
    assert producers[4] == "call-2"  # the tool message's content is lookup's output
    # A step's input is a cursor of constant size, however long the transcript.
    with chat.runtime.db.begin() as conn:
        inputs = conn.execute(
            select(steps.c.input).where(steps.c.run_id == run.id, steps.c.name == "respond")
        ).scalars()
        sizes = {len(text) for text in inputs}
        rows = conn.execute(
            select(func.count()).select_from(messages).where(messages.c.run_id == run.id)
        ).scalar_one()
        # A reply that is its step's output, unchanged, is recorded as that output.
        as_output = conn.execute(
            select(messages.c.step_id).where(
                messages.c.run_id == run.id, messages.c.body == SAME_AS_OUTPUT
            )
        ).scalars()
        referenced = sorted(as_output)
    assert max(sizes) < 120, sizes
    assert rows == len(info.messages)
    assert referenced == [f"respond#{i}" for i in range(1, 7)]
    # The step saw the whole window each turn (one respond per turn: none re-asked).
    seen = [e["seen"] for e in executions(backend, run.id) if e["event"] == "respond"]
    assert seen == [1, 3, 6, 8, 11, 13]


def test_steps_see_the_window_after_a_compaction_and_raw_stays_whole(
    backend: Backend, chat: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", app=APP)
    run = chat.enqueue("chatty", 6, 2)
    run.wait(timeout=60)
    info = chat.transcript(run.id)
    # Compactions rewrote and removed nothing: every message appended is there.
    assert [m.get("role") for m in info.raw()] == [m["role"] for m in _expected_chatty(6)]
    seen = [e["seen"] for e in executions(backend, run.id) if e["event"] == "respond"]
    replies = [m["content"] for m in info.raw() if m.get("role") == "assistant"]
    assert [int(r.split(" saw ")[1].split()[0]) for r in replies] == seen
    assert [(c.number, c.status) for c in info.compactions] == [
        (1, "done"),
        (2, "done"),
        (3, "done"),
    ]
    # Each compaction folds the previous summary and the raw messages after it.
    assert [(c.start, c.base) for c in info.compactions] == [(0, None), (3, 1), (8, 2)]
    current = info.current
    assert current is not None and current.number == 3
    window = info.window()
    assert window[0]["role"] == "system" and window[0]["content"].startswith("summary: ")
    assert window[1:] == info.raw()[current.upto :]
    # What respond saw after a compaction was the window, not the raw history.
    assert seen[2] == 1 + 3  # the summary, the tool call and its result, a message


def test_a_changed_append_is_a_non_determinism_error_naming_the_position(
    backend: Backend, chat: Fleet, cluster: Cluster
) -> None:
    first = cluster.worker("w1", app=APP)
    run = chat.enqueue("drifting")
    poll(lambda: run.status() == "waiting", 30, "the run to wait for 'go'")
    recorded = chat.transcript(run.id).raw()
    assert recorded[1] == {"role": "assistant", "content": "variant a"}
    first.signal(signal.SIGKILL)
    backend.extra_env["CHAT_VARIANT"] = "b"  # a code change: the worker appends otherwise
    cluster.worker("w2", app=APP)
    chat.signal(run.id, "go", True)
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=60)
    error = str(failed.value)
    assert "NonDeterminism" in error and "message 1 of transcript 'main'" in error, error
    assert "variant a" in error and "variant b" in error
    assert chat.transcript(run.id).raw() == recorded  # nothing rewritten


def test_a_bad_compaction_is_undone_by_compacting_again_over_raw(
    backend: Backend, chat: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", app=APP)
    run = chat.enqueue("forgetful")
    poll(lambda: run.status() == "waiting", 30, "the run to wait after its first compaction")
    info = chat.transcript(run.id)
    raw = info.raw()
    assert len(raw) == 4 and "the vault code is 4471" in json.dumps(raw)
    assert "vault" not in json.dumps(info.window())  # the lossy summary dropped it
    chat.signal(run.id, "redo")
    first, second, window_len = run.wait(timeout=60)
    assert "vault" not in json.dumps(first) and "the vault code is 4471" in json.dumps(second)
    info = chat.transcript(run.id)
    assert info.raw() == raw  # raw complete throughout
    assert [(c.number, c.start, c.base) for c in info.compactions] == [(1, 0, None), (2, 0, None)]
    assert info.current is not None and info.current.number == 2
    assert "the vault code is 4471" in json.dumps(info.window())
    assert window_len == 2  # the new summary and the message kept
