"""A run's history exported (``fleet.testing.export``, issue 50) and replayed from the
file with no database (``fleet.testing.replay(history=)``): the same ``Replay`` as from
the store once the store is gone, a changed workflow named the same way, secrets by
name only and large values carried once by digest. Both stores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet import Fleet, NonDeterminism
from fleet.errors import BadInput, StoreUnavailable
from fleet.testing import InlineBroker, export, replay
from tests import replay_flows
from tests.harness import Backend, delete_store
from tests.replay_flows import BODIES, CHANGED, KEY, LARGE

SECRET_VALUE = "value-of-the-key-0f3c9a"


def _record(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Three runs: ``agent`` finished (transcript, compaction, child, wait, values),
    ``agent`` stopped at its wait, ``keyed`` finished (a secret, a large output)."""
    monkeypatch.setenv(KEY, SECRET_VALUE)
    broker = InlineBroker(fleet)
    runs = {
        "finished": fleet.enqueue("agent", "durable runs").id,
        "waiting": fleet.enqueue("agent", "open question").id,
        "keyed": fleet.enqueue("keyed", "hello").id,
    }
    broker.drain()
    fleet.signal(runs["finished"], "approval", {"approved": True})
    broker.drain()
    assert [fleet.run(r).status() for r in runs.values()] == ["succeeded", "waiting", "succeeded"]
    return runs


def test_a_history_file_replays_as_the_store_does_with_the_store_gone(
    backend: Backend, recorder: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = _record(recorder, monkeypatch)
    from_store = {name: replay(run_id, fleet=recorder) for name, run_id in runs.items()}
    assert from_store["waiting"].wait == "approval"
    assert from_store["keyed"].result == {"signed": "hello (23-character key)", "padding": LARGE}
    files: dict[str, Path] = {}
    for name, run_id in runs.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(export(run_id, fleet=recorder)))
    keyed = files["keyed"].read_text()
    assert SECRET_VALUE not in keyed and '{\\"$fleet_secret\\":\\"REPLAY_FLOWS_KEY\\"}' in keyed
    document = json.loads(keyed)
    (step,) = document["steps"]
    assert step["output"].startswith("blob:"), "the large output is referenced, as stored"
    assert list(document["blobs"]) == [step["output"].removeprefix("blob:")]

    delete_store(backend, recorder)
    with pytest.raises(StoreUnavailable):
        replay(runs["finished"], fleet=recorder)
    BODIES.clear()
    for name, run_id in runs.items():
        assert replay(history=files[name], fleet=recorder) == from_store[name], name
        given = json.loads(files[name].read_text())  # the document, and no Fleet at all
        workflow = replay_flows.keyed if name == "keyed" else replay_flows.agent
        assert replay(run_id, history=given, workflow=workflow) == from_store[name], name
    assert sum(BODIES.values()) == 0, f"step bodies ran in a replay: {BODIES}"
    with pytest.raises(NonDeterminism, match="'add#1'.*'think#1'"):
        replay(history=files["finished"], fleet=recorder, workflow=CHANGED["asks_first"])
    with pytest.raises(BadInput, match="the history is of run"):
        replay("another-run", history=files["finished"], fleet=recorder)
