"""An exported history read back (fleet/store/exports.py): a document that is not one,
or whose rows do not hold together, is refused in one line naming what is wrong, before
any replay; a good one replays as the store does. On an embedded store in a temporary
folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet import Fleet, Settings
from fleet.errors import BadInput
from fleet.store import exports
from fleet.testing import InlineBroker, export, replay
from tests import replay_flows


@pytest.fixture
def recorded(tmp_path: Path) -> Iterator[tuple[Fleet, dict[str, Any]]]:
    """The replay flows' Fleet on a new embedded store, and the export of one finished
    run of ``agent``."""
    settings = Settings(
        database_url=f"sqlite:///{tmp_path}/fleet.db", broker_url=f"filesystem:///{tmp_path}/b"
    )
    fleet = replay_flows.fleet.with_settings(settings)
    fleet.upgrade_schema()
    broker = InlineBroker(fleet)
    run = fleet.enqueue("agent", "durable runs")
    broker.drain()
    fleet.signal(run.id, "approval", {"approved": True})
    broker.drain()
    yield fleet, export(run.id, fleet=fleet)
    fleet.runtime.db.dispose()


def test_a_document_that_is_not_a_good_history_is_refused_in_one_line(
    recorded: tuple[Fleet, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet, good = recorded

    def broken(**change: Any) -> dict[str, Any]:
        return {**json.loads(json.dumps(good)), **change}

    steps = broken()["steps"]
    del steps[0]["seq"]
    messages = broken()["messages"]
    messages[1]["pos"] = 5
    twice = broken()["steps"]
    twice[1]["step_id"] = twice[0]["step_id"]
    cases: list[tuple[Any, str]] = [
        ({"format": "other"}, "not a fleet history"),
        (broken(version=2), "version 2: this fleet reads version 1"),
        (broken(steps=steps), "step 0 of the history lacks seq"),
        (broken(steps=twice), "holds a step id twice"),
        (broken(run={**good["run"], "status": "bogus"}), "'bogus' is not a valid RunStatus"),
        (broken(run={**good["run"], "wake_seq": "7"}), "wake_seq should be int, not str"),
        (broken(run={**good["run"], "detached": 0}), "detached should be bool, not int"),
        (broken(messages=messages), "transcript 'main' of the history has no message 1"),
        (broken(blobs=[]), "blobs are not an object"),
        (broken(usage=None), "its usage is not a JSON object"),
    ]
    for document, needle in cases:
        with pytest.raises(BadInput, match=needle) as refused:
            replay(history=document, fleet=fleet)
        assert "\n" not in str(refused.value)
    torn = tmp_path / "torn.json"
    torn.write_text(json.dumps(good)[:-40])
    with pytest.raises(BadInput, match="torn.json is not JSON"):
        replay(history=torn, fleet=fleet)
    with pytest.raises(BadInput, match="absent.json cannot be read"):
        replay(history=tmp_path / "absent.json", fleet=fleet)
    monkeypatch.setattr(exports, "MAX_FILE_BYTES", 100)
    with pytest.raises(BadInput, match="torn.json is .* bytes, over 100"):
        replay(history=torn, fleet=fleet)
    with pytest.raises(BadInput, match="a store .* or a history .* not both"):
        replay(history=good, fleet=fleet, database_url=fleet.settings.database_url)


def test_a_good_history_replays_as_the_store_does(
    recorded: tuple[Fleet, dict[str, Any]], tmp_path: Path
) -> None:
    fleet, good = recorded
    run_id = good["run"]["id"]
    from_store = replay(run_id, fleet=fleet)
    assert from_store.status == "finished" and from_store.replayed == 9
    path = tmp_path / "run.json"
    path.write_text(json.dumps(good))
    assert replay(history=path, fleet=fleet) == from_store
    assert replay(run_id, history=str(path), workflow=replay_flows.agent) == from_store
