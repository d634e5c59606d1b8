"""``fleet replay`` and ``fleet export`` as a user meets them (issue 50): real
subprocesses over runs recorded on the backend. A recorded run replays to its result
(exit 0); code changed since names the first step it no longer takes (exit 1); bad
input is one line (exit 2); an exported file, the store gone, replays to the same
``Replay`` and holds a secret by its name only."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from fleet import Fleet
from fleet.testing import InlineBroker, replay
from tests.e2e.test_cli import fleet_cli, one_line_error
from tests.harness import Backend, delete_store
from tests.replay_flows import KEY

APP = "tests.replay_flows"
SECRET_VALUE = "value-of-the-key-7d41e2"


def _finished(fleet: Fleet, workflow: str, *args: object, approve: bool = False) -> str:
    broker = InlineBroker(fleet)
    run_id = fleet.enqueue(workflow, *args).id
    broker.drain()
    if approve:
        fleet.signal(run_id, "approval", {"approved": True})
        broker.drain()
    assert fleet.run(run_id).status() == "succeeded"
    return run_id


def test_replay_exits_0_as_recorded_1_when_the_code_changed_2_on_bad_input(
    backend: Backend, recorder: Fleet
) -> None:
    run_id = _finished(recorder, "agent", "durable runs", approve=True)
    done = fleet_cli(backend, "replay", run_id, "-A", APP)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = " ".join(done.stdout.split())  # as read, whatever the wrapping
    assert "replayed finished" in shown and "9 recorded (no step body run)" in shown
    assert '"child": 42' in shown and '"total": 54' in shown

    edited = backend.env(REPLAY_FLOWS_CHANGE="asks_first")  # a step added before the first
    changed = fleet_cli(backend, "replay", run_id, "-A", APP, env=edited)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    (line,) = changed.stderr.strip().splitlines()
    assert "non-determinism" in line and "position 1" in line and "'add#1'" in line, line

    one_line_error(fleet_cli(backend, "replay", "no-such-run", "-A", APP), "no-such-run")
    if backend.kind == "sqlite":  # the same with any store: no app, no workflow to run
        one_line_error(fleet_cli(backend, "replay", run_id), "no app loaded", "pass -A APP")


def test_export_then_replay_the_file_with_the_store_gone(
    backend: Backend, recorder: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY, SECRET_VALUE)  # read by the step body, in this process
    run_id = _finished(recorder, "keyed", "hello")
    from_store = replay(run_id, fleet=recorder)
    history = tmp_path / "run.json"
    with history.open("w") as out:
        exported = subprocess.run(
            [sys.executable, "-m", "fleet", "export", run_id],
            env=backend.env(),
            cwd=backend.workdir,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert exported.returncode == 0, exported.stderr
    text = history.read_text()
    assert SECRET_VALUE not in text, "a secret's value is in the export"
    assert KEY in text and json.loads(text)["format"] == "fleet-run-history"

    delete_store(backend, recorder)
    where = "no such file" if backend.kind == "sqlite" else "does not exist"
    one_line_error(fleet_cli(backend, "replay", run_id, "-A", APP), "unavailable", where)

    again = fleet_cli(backend, "replay", "--file", str(history), "-A", APP, "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout) == json.loads(json.dumps(asdict(from_store)))
