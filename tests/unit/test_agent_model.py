"""The stand-in model's tool-using side (``StandInModel.chat``), played without the
engine: the test stands in for the workflow, running the tools on the fixed notes.

No services: nothing here enqueues a run or needs a worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tasks import agent
from tasks import model as m

Message = dict[str, Any]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FLEET_MODEL", "FLEET_MODEL_LATENCY", m.CALLS_ENV):
        monkeypatch.delenv(name, raising=False)


def _tool_result(name: str, args: dict[str, Any], approved: bool) -> str:
    """What the agent's tools return, computed here from the same fixed notes."""
    if name == "list_notes":
        return json.dumps({"notes": sorted(agent.NOTES)})
    if name == "read_note":
        return json.dumps({"name": args["name"], "text": agent.NOTES[args["name"]]})
    if name == "write_note":
        return json.dumps({"written": args["name"], "bytes": len(args["text"].encode())})
    if not approved:
        return json.dumps({"refused": args["name"], "by": "test"})
    return json.dumps({"deleted": args["name"]})


def play(
    compact_every: int = 0,
    approved: bool = True,
    tools: list[dict[str, Any]] | None = None,
    run: str = "r1",
) -> tuple[list[Message], int]:
    """The agent's loop in plain Python: the raw transcript and the number of turns.
    With ``compact_every``, the model is shown a summary and the last four messages."""
    model = m.StandInModel()
    raw: list[Message] = [
        {"role": "system", "content": agent.SYSTEM},
        {"role": "user", "content": agent.TASK},
    ]
    head: list[Message] = []
    upto = 0
    for turn in range(1, agent.MAX_TURNS + 1):
        window = [*head, *raw[upto:]]
        reply = model.chat(window, tools or agent.TOOL_SPECS, tag={"run": run, "turn": turn})
        assert reply.data is not None
        raw.append(reply.data)
        calls = reply.data.get("tool_calls") or []
        if not calls:
            return raw, turn
        for c in calls:
            name, args = c["function"]["name"], json.loads(c["function"]["arguments"])
            content = _tool_result(name, args, approved)
            raw.append({"role": "tool", "tool_call_id": c["id"], "name": name, "content": content})
        if compact_every and turn % compact_every == 0:
            new_upto = len(raw) - agent.KEEP_LAST
            summary = model.summarize_chat([*head, *raw[upto:new_upto]], tag={"run": run})
            head = [{"role": "system", "content": agent.SYSTEM}]
            head.append({"role": "system", "content": summary.text})
            upto = new_upto
    raise AssertionError("the stand-in never gave a final answer")


def _calls(raw: list[Message]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for msg in raw
        for c in msg.get("tool_calls") or []
    ]


def test_chat_is_deterministic() -> None:
    assert play() == play()
    assert play(compact_every=2) == play(compact_every=2)


def test_the_planned_tool_calls_come_in_order() -> None:
    raw, turns = play()
    names = sorted(agent.NOTES)
    calls = _calls(raw)
    assert [c[0] for c in calls] == [
        "list_notes",
        *["read_note"] * len(names),
        "write_note",
        "delete_note",
    ]
    assert [c[1]["name"] for c in calls[1 : 1 + len(names)]] == names
    assert calls[-2][1]["name"] == m.DIGEST and "Digest of 6 notes" in calls[-2][1]["text"]
    assert calls[-1][1] == {"name": "scratch"}
    assert turns == 7  # list, three turns of two reads, write, delete, answer
    assert "tool_calls" not in raw[-1] and "I deleted 'scratch'" in raw[-1]["content"]
    ids = [c["id"] for msg in raw for c in msg.get("tool_calls") or []]
    assert len(set(ids)) == len(ids), "tool call ids are unique in a run"


@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_a_summary_stands_in_for_the_messages_it_replaced(every: int) -> None:
    """Shown only a summary and the last four messages, the model makes the same moves."""
    assert play(compact_every=every) == play()


def test_a_refused_delete_keeps_the_note() -> None:
    raw, _ = play(approved=False)
    assert "I kept 'scratch': deleting it was refused" in raw[-1]["content"]


def test_a_tool_not_offered_is_not_called() -> None:
    without_delete = [t for t in agent.TOOL_SPECS if t["function"]["name"] != "delete_note"]
    raw, turns = play(tools=without_delete)
    assert "no tool 'delete_note'" in raw[-1]["content"] and turns == 6
    assert "delete_note" not in [c[0] for c in _calls(raw)]


def test_messages_are_openai_shaped_and_sized() -> None:
    raw, _ = play()
    replies = [msg for msg in raw if msg["role"] == "assistant"]
    for msg in replies:
        assert isinstance(msg["content"], str)
        assert 60 <= len(json.dumps(msg)) <= 2048
        for c in msg.get("tool_calls") or []:
            assert c["type"] == "function" and c["id"].startswith("call_")
            assert isinstance(json.loads(c["function"]["arguments"]), dict)


def test_usage_is_recorded_and_the_pin_named() -> None:
    reply = m.StandInModel().chat(
        [{"role": "user", "content": agent.TASK}], agent.TOOL_SPECS, model="pinned-1"
    )
    assert reply.model == "pinned-1" and reply.usage["model"] == "pinned-1"
    assert reply.input_tokens > 0 and reply.output_tokens > 0 and reply.cost > 0


def test_the_call_log_counts_every_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv(m.CALLS_ENV, str(log))
    _, turns = play(compact_every=3, run="a")
    play(run="b")
    calls = m.read_calls(log)
    chats = [(c["run"], c["turn"]) for c in calls if c["kind"] == "chat"]
    assert chats == [("a", t) for t in range(1, turns + 1)] + [("b", t) for t in range(1, 8)]
    assert [c["run"] for c in calls if c["kind"] == "summarize"] == ["a", "a"]
    assert all(isinstance(c["pid"], int) for c in calls)


def test_no_call_log_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    play()
    assert list(tmp_path.iterdir()) == []
    assert m.read_calls(tmp_path / "missing.jsonl") == []
