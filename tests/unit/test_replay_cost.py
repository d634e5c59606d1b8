"""A replay's cost per recorded step (issue #19): each done step's output is decoded
once per process (``DecodedOutputs``, fleet/store/history.py) and the common
recorded-and-done step takes a fast path in ``WorkflowContext.step``. Neither may
change what a replay sees: a workflow that changes what a step returned must see the
recorded value again on the next replay, secrets and blobs load as before, and every
determinism check still holds on the fast path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet import Fleet, Secret, Settings, StepContext, StepFailed, WorkflowContext, codec
from fleet.errors import LimitExceeded, NonDeterminism
from fleet.states import RunStatus, StepKind, StepStatus
from fleet.store.history import COPY, DECODE, FRESH, SHARE, DecodedOutputs, handout
from fleet.store.rows import RunRow, StepRow
from fleet.testing import InlineBroker
from fleet.transcripts import Cursor
from fleet.worker.workflow import Suspend

app = Fleet("replay-cost", settings=Settings(broker_url="redis://127.0.0.1:1/0"))


@app.step
def nested(ctx: StepContext, i: int) -> dict[str, Any]:
    return {"i": i, "meta": {"tags": ["a"]}}


@app.step
def flat(ctx: StepContext, i: int) -> dict[str, Any]:
    return {"i": i, "note": "recorded"}


@app.step
def listed(ctx: StepContext, i: int) -> list[int]:
    return [i, i]


@app.step
def leaf(ctx: StepContext, i: int) -> int:
    return i


@app.workflow
def mutating(wf: WorkflowContext, n: int) -> list[Any]:
    """Changes every output it is given, in place, as a workflow may."""
    seen: list[Any] = []
    for i in range(n):
        a = wf.step(nested, i)
        a["meta"]["tags"].append("seen")
        a["i"] += 100
        b = wf.step(flat, i)
        b["note"] += " (changed)"
        c = wf.step(listed, i)
        c.append(-1)
        seen.append([a, b, c])
    return seen


def _client(tmp_path: Path) -> Fleet:
    fleet = app.with_settings(
        Settings(database_url=f"sqlite:///{tmp_path}/a.db", broker_url=app.settings.broker_url)
    )
    fleet.upgrade_schema()
    return fleet


def test_outputs_changed_by_a_workflow_are_recorded_again_on_every_replay(
    tmp_path: Path,
) -> None:
    fleet = _client(tmp_path)
    broker = InlineBroker(fleet)
    run = fleet.enqueue("mutating", 3)
    broker.drain()
    # Replayed ten times over history rows this process cached (the same row objects,
    # their outputs decoded once); each output was changed by each replay.
    assert fleet.runtime.db.history.hits > 0 and len(fleet.runtime.db.history.outputs) > 0
    assert run.wait(timeout=0) == [
        [
            {"i": 100 + i, "meta": {"tags": ["a", "seen"]}},
            {"i": i, "note": "recorded (changed)"},
            [i, i, -1],
        ]
        for i in range(3)
    ]


@app.workflow
def waiting(wf: WorkflowContext, n: int) -> list[Any]:
    """Changes every signal's payload it is given, in place."""
    seen: list[Any] = []
    for i in range(n):
        got = wf.wait_for("go")
        seen.append(list(got["tags"]))
        got["tags"].append("changed")
        wf.step(leaf, i)
    return seen


def test_signal_payloads_changed_by_a_workflow_are_recorded_again(tmp_path: Path) -> None:
    fleet = _client(tmp_path)
    broker = InlineBroker(fleet)
    run = fleet.enqueue("waiting", 3)
    broker.drain()
    for _ in range(3):
        assert run.status() == "waiting"
        fleet.signal(run.id, "go", {"tags": ["a"]})
        broker.drain()
    assert run.wait(timeout=0) == [["a"]] * 3


# --- replays driven directly over history rows built in memory --------------------


def _row(pos: int, step_id: str, name: str, output: str | None, status: StepStatus) -> StepRow:
    return StepRow(
        "r", step_id, pos, name, StepKind.TASK, "{}", status, output,
        "boom" if status is StepStatus.DEAD else None,
        1, 3, 1, None, None, None, None, 1, 0.0, None, None,
    )  # fmt: skip


def _history(*steps: tuple[str, Any], end: StepStatus = StepStatus.RUNNING) -> list[StepRow]:
    """Done rows for ``(step id, output)`` pairs (the name is the id before ``#``), then
    one row of status ``end`` (a step of ``leaf``) where the replay stops."""
    rows = [
        _row(pos, sid, sid.partition("#")[0], codec.encode(out, what=sid, limit=1 << 20),
             StepStatus.DONE)
        for pos, (sid, out) in enumerate(steps)
    ]  # fmt: skip
    return [*rows, _row(len(rows), "end", "leaf", None, end)]


_RUN = RunRow(
    "r", "x", "1", "{}", '{"args":[],"kwargs":{}}', "fleet", RunStatus.RUNNING, None, None, 1,
    1, None, 1, 0.0, 0.0, None, None, None, None, None, None, False, None,
)  # fmt: skip


def _replay(fleet: Fleet, rows: list[StepRow], body: Any) -> list[Any]:
    """Run ``body(wf)`` over ``rows`` as a replay does; what it handed out, in order.
    It stops at the last row (not done), with ``wf.step(leaf, 0, key="end")``."""
    wf = WorkflowContext(fleet.runtime, _RUN, rows)
    got: list[Any] = []
    with pytest.raises(Suspend):
        body(wf, got)
        wf.step(leaf, 0, key="end")
    assert not wf.new_tasks
    return got


def test_a_decoded_output_is_never_shared_across_replays(tmp_path: Path) -> None:
    fleet = _client(tmp_path)
    outputs = [{"i": 1, "meta": {"tags": ["a"]}}, {"i": 1, "note": "n"}, [1, 2], "text", 7]
    rows = _history(
        ("nested#1", outputs[0]), ("flat#1", outputs[1]), ("listed#1", outputs[2]),
        ("leaf#1", outputs[3]), ("leaf#2", outputs[4]),
    )  # fmt: skip

    def body(wf: WorkflowContext, got: list[Any]) -> None:
        for fn in (nested, flat, listed, leaf, leaf):
            value = wf.step(fn, 0)
            got.append(codec.decode(codec.encode(value, what="v", limit=1 << 20)))
            if isinstance(value, dict):
                value["i"] = "changed"
                value.setdefault("meta", {}).setdefault("tags", []).append("changed")
            elif isinstance(value, list):
                value.append("changed")

    for _ in range(3):  # the first replay decodes, the next ones hand out the kept values
        assert _replay(fleet, rows, body) == outputs
    assert len(fleet.runtime.db.history.outputs) == 5


def test_outputs_holding_secrets_or_cursors_are_decoded_again(tmp_path: Path) -> None:
    fleet = _client(tmp_path)
    cursor = Cursor("r", "main", 0, 2)
    rows = _history(("flat#1", {"key": Secret.env("API_KEY"), "c": [cursor]}))
    handed: list[Any] = []

    def body(wf: WorkflowContext, got: list[Any]) -> None:
        value = wf.step(flat, 0)
        handed.append(value)
        got.append((value["key"].name, value["c"][0]))
        value["c"].clear()

    for _ in range(2):
        assert _replay(fleet, rows, body) == [("API_KEY", cursor)]
    assert handed[0] is not handed[1] and handed[0]["key"] is not handed[1]["key"]


def test_a_blob_output_is_read_and_decoded_once_and_handed_out_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = _client(tmp_path)
    rt = fleet.runtime
    big = {"text": "x" * (rt.settings.max_payload_bytes + 1), "tags": ["a"]}
    ref = rt.payloads.dump(big, what="big")
    assert ref.startswith("blob:")
    rows = _history(("nested#1", None))
    rows[0] = _row(0, "nested#1", "nested", ref, StepStatus.DONE)
    reads: list[str] = []
    blob = rt.queries.blob
    monkeypatch.setattr(rt.queries, "blob", lambda digest: reads.append(digest) or blob(digest))

    def body(wf: WorkflowContext, got: list[Any]) -> None:
        value = wf.step(nested, 0)
        got.append(list(value["tags"]))
        value["tags"].append("changed")

    assert _replay(fleet, rows, body) == [["a"]]
    assert _replay(fleet, rows, body) == [["a"]]
    assert len(reads) == 1


def test_the_fast_path_keeps_every_determinism_check(tmp_path: Path) -> None:
    fleet = _client(tmp_path)
    rows = _history(("leaf#1", 1), ("leaf#2", 2))

    def renamed(wf: WorkflowContext, got: list[Any]) -> None:
        got.append(wf.step(leaf, 0))
        got.append(wf.step(flat, 0))  # the history has leaf#2 here

    with pytest.raises(NonDeterminism, match=r"position 2 .* 'flat#1' \(flat\) .* 'leaf#2'"):
        _replay(fleet, rows, renamed)

    # A key equal to an id already used (rows a store would refuse, built here).
    twice = _history(("leaf#1", 1))
    twice.insert(1, _row(1, "leaf#1", "leaf", "1", StepStatus.DONE))

    def duplicate(wf: WorkflowContext, got: list[Any]) -> None:
        got.append(wf.step(leaf, 0))
        got.append(wf.step(leaf, 0, key="leaf#1"))

    with pytest.raises(NonDeterminism, match="used twice"):
        _replay(fleet, twice, duplicate)

    def keyed(wf: WorkflowContext, got: list[Any]) -> None:
        got.append(wf.step(leaf, 0, key="leaf#2"))  # the history has leaf#1 first

    with pytest.raises(NonDeterminism, match="position 1"):
        _replay(fleet, rows, keyed)

    def in_order(wf: WorkflowContext, got: list[Any]) -> None:
        got.append(wf.step("leaf", 0))  # by name, then by def: the same step
        got.append(wf.step(leaf, 0))

    assert _replay(fleet, rows, in_order) == [1, 2]


def test_a_step_not_done_is_not_taken_for_a_recorded_output(tmp_path: Path) -> None:
    fleet = _client(tmp_path)
    wf = WorkflowContext(fleet.runtime, _RUN, _history(("leaf#1", 1), end=StepStatus.DEAD))
    assert wf.step(leaf, 0) == 1
    with pytest.raises(StepFailed, match="boom"):
        wf.step(leaf, 0, key="end")
    running = WorkflowContext(fleet.runtime, _RUN, _history(end=StepStatus.RUNNING))
    with pytest.raises(Suspend):
        running.step(leaf, 0, key="end")


def test_max_steps_still_stops_a_run_past_its_history(tmp_path: Path) -> None:
    fleet = _client(tmp_path).with_settings(
        Settings(
            database_url=f"sqlite:///{tmp_path}/a.db",
            broker_url=app.settings.broker_url,
            max_steps=2,
        )
    )
    rows = _history(("leaf#1", 1), ("leaf#2", 2))[:2]
    wf = WorkflowContext(fleet.runtime, _RUN, rows)
    assert [wf.step(leaf, 0), wf.step(leaf, 0)] == [1, 2]
    with pytest.raises(LimitExceeded, match="FLEET_MAX_STEPS=2"):
        wf.step(leaf, 0)


# --- the cache itself ------------------------------------------------------------


def test_each_output_is_handed_out_as_safely_as_it_needs() -> None:
    assert [handout(v) for v in (None, True, 1, 1.5, "s")] == [SHARE] * 5
    assert [handout(v) for v in ({"a": 1, "b": None}, [1, "x"], {}, [])] == [COPY] * 4
    assert [handout(v) for v in ({"a": [1]}, [{"a": 1}], [[]])] == [FRESH] * 3
    assert handout({"k": Secret.env("K")}) == DECODE
    assert handout([Cursor("r", "main", 0, 1)]) == DECODE


def test_the_decoded_outputs_are_bounded_and_keyed_by_the_row_itself() -> None:
    outputs = DecodedOutputs(max_entries=2, max_bytes=10_000)
    a, b, c = (_row(i, f"s#{i}", "s", "[1]", StepStatus.DONE) for i in range(3))
    for row in (a, b, c):
        outputs.keep(row, [1], 3)
    assert outputs.get(a) is None and outputs.get(c) is not None, "the oldest went first"
    same = _row(2, "s#2", "s", "[1]", StepStatus.DONE)
    assert same == c and outputs.get(same) is None, "an equal row read afresh is not it"
    huge = _row(3, "s#3", "s", "[1]", StepStatus.DONE)
    entry = outputs.keep(huge, [1], 20_000)
    assert entry[1:3] == (COPY, [1]) and outputs.get(huge) is None, "too large to keep"
    outputs.keep(a, "x" * 4800, 4800)
    assert len(outputs) == 1 and outputs.get(a) is not None, "the bytes bound evicts too"
    outputs.clear()
    assert len(outputs) == 0
