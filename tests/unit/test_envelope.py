"""The envelope check (fleet.envelope) on its own: what Celery itself sends passes; each
kind of poison is refused with a reason, never with an unforeseen exception."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from fleet import Fleet, Settings
from fleet.worker.envelope import (
    MAX_RUN_ID,
    MAX_STEP_ID,
    Malformed,
    as_text,
    check,
    is_control_queue,
    one_line,
)


@pytest.fixture(scope="module")
def sent(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Messages as fleet's Dispatcher and this Celery version write them: an advance, and
    an execute with a countdown (an ``eta`` header)."""
    tmp: Path = tmp_path_factory.mktemp("envelope")
    fleet = Fleet(
        "envelope",
        settings=Settings(
            database_url=f"sqlite:///{tmp}/fleet.db", broker_url=f"filesystem:///{tmp}/broker"
        ),
    )
    fleet.upgrade_schema()
    assert fleet.runtime.dispatcher.advance("r" * MAX_RUN_ID, "fleet")
    assert fleet.runtime.dispatcher.execute(
        "run-1", "s" * MAX_STEP_ID, "fleet", shadow="wf.step#1", countdown=5
    )
    files = sorted((tmp / "broker" / "queue").iterdir())
    assert len(files) == 2
    return [json.loads(f.read_text()) for f in files]


def _body(message: dict[str, Any], body: Any) -> dict[str, Any]:
    out = copy.deepcopy(message)
    out["body"] = base64.b64encode(json.dumps(body).encode()).decode()
    return out


def _headers(message: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(message)
    out["headers"].update(changes)
    return out


def test_what_celery_sends_passes(sent: list[dict[str, Any]]) -> None:
    for message in sent:
        check("fleet", message)
        # kombu's Redis transport marks a restored message in its headers.
        check("fleet", _headers(message, redelivered=True))


def _poisons(advance: dict[str, Any]) -> list[tuple[str, Any]]:
    good_body = json.loads(base64.b64decode(advance["body"]))
    bad_base64 = copy.deepcopy(advance)
    bad_base64["body"] = "not base64!"
    no_props = copy.deepcopy(advance)
    del no_props["properties"]
    return [
        ("an object body", _body(advance, {"a": 1})),
        ("a number body", _body(advance, 5)),
        ("bad base64", bad_base64),
        ("no properties", no_props),
        ("not an envelope", 5),
        ("a list", [1, 2]),
        ("two ids to advance", _body(advance, [["a", "b"], {}, good_body[2]])),
        ("a number id", _body(advance, [[1], {}, {}])),
        ("an empty id", _body(advance, [[""], {}, {}])),
        ("a control character", _body(advance, [["a\nb"], {}, {}])),
        ("a 1 MB id", _body(advance, [["r" * 1_000_000], {}, {}])),
        ("keyword arguments", _body(advance, [["a"], {"x": 1}, {}])),
        ("a callback", _body(advance, [["a"], {}, {"callbacks": [{"task": "celery.ping"}]}])),
        ("embed not an object", _body(advance, [["a"], {}, []])),
        ("an unknown task", _headers(advance, task="celery.chord_unlock")),
        ("a task that is a list", _headers(advance, task=["fleet.advance"])),
        ("a chain header", _headers(advance, chain=[{"task": "celery.ping"}])),
        ("a time limit", _headers(advance, timelimit=[1, 2])),
        ("a bad eta", _headers(advance, eta="tomorrow")),
        ("no task id", _headers(advance, id=None)),
        ("xml", {**advance, "content-type": "application/xml"}),
    ]


def test_each_poison_is_refused_with_a_reason(sent: list[dict[str, Any]]) -> None:
    advance = sent[0] if sent[0]["headers"]["task"] == "fleet.advance" else sent[1]
    for name, message in _poisons(advance):
        with pytest.raises(Malformed) as refused:
            check("fleet", message)
        reason = str(refused.value)
        assert reason and "\n" not in reason and len(reason) < 300, (name, reason)


def test_ids_at_the_store_limits_pass_and_one_more_does_not(sent: list[dict[str, Any]]) -> None:
    execute = sent[0] if sent[0]["headers"]["task"] == "fleet.execute" else sent[1]
    check("fleet", _body(execute, [["r" * MAX_RUN_ID, "s" * MAX_STEP_ID], {}, {}]))
    for args in (["r" * (MAX_RUN_ID + 1), "s"], ["r", "s" * (MAX_STEP_ID + 1)]):
        with pytest.raises(Malformed, match="at most"):
            check("fleet", _body(execute, [args, {}, {}]))


def test_control_queues_need_only_a_readable_envelope(sent: list[dict[str, Any]]) -> None:
    assert is_control_queue("celery@host.celery.pidbox")
    assert is_control_queue("celeryev.1234")
    assert not is_control_queue("fleet")
    pidbox = _body(sent[0], {"method": "ping", "arguments": {}, "destination": None})
    pidbox["headers"] = {"clock": 1, "expires": None}
    check("w@host.celery.pidbox", pidbox)
    with pytest.raises(Malformed):
        check("fleet", pidbox)
    with pytest.raises(Malformed):
        check(
            "w@host.celery.pidbox",
            {"body": "!!", "properties": {"delivery_tag": "t", "body_encoding": "base64"}},
        )
    with pytest.raises(Malformed):
        check("w@host.celery.pidbox", {"body": 5, "properties": {"delivery_tag": "t"}})


def test_one_line_and_as_text_hold_any_bytes() -> None:
    line = one_line("a\nb\x00[/]" + "x" * 1000, 20)
    assert "\n" not in line and "\x00" not in line and "(1007 characters)" in line
    assert as_text(b"\xff\x00ok") == "\\xff\x00ok"
    assert as_text({"k": "\ud800"}) == '{"k": "\\ud800"}'
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    assert as_text(deep)  # too deep for JSON: still some text


def test_a_task_called_without_the_broker_check_refuses_the_same_ids() -> None:
    """``fleet.tasks`` checks the ids again for a task called some other way (eagerly, or
    through a transport that is not fleet's), by the envelope's own rule."""
    from fleet.worker.dispatch import ADVANCE, EXECUTE
    from fleet.worker.envelope import MAX_RUN_ID, MAX_STEP_ID
    from fleet.worker.tasks import _ids

    longest = ("r" * MAX_RUN_ID, "s" * MAX_STEP_ID)
    assert _ids(longest, EXECUTE) == longest
    for bad in [(), ("r", "s"), ("",), (5,), ("r\x00",), ("r" * (MAX_RUN_ID + 1),)]:
        assert _ids(bad, ADVANCE) is None, bad
    assert _ids(("r", "s" * (MAX_STEP_ID + 1)), EXECUTE) is None
