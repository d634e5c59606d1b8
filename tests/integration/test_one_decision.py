"""Invariant 14: one decision answers one wait. A signal sent with ``wait_id`` settles
that open wait in one conditional write, or is refused with nothing recorded; sent
twice, concurrently, exactly one lands, and the run's next wait is never answered by
the second. On both stores, with real workers, through the API and the CLI."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from fleet import Fleet, WaitNotOpen
from fleet.states import StepStatus
from tests.e2e.test_cli import fleet_cli, one_line_error
from tests.harness import Backend, Cluster, poll, together

APPROVE = {"approved": True}


def _open_waits(client: Fleet, run_id: str) -> list[str]:
    return [w.id for w in client.run(run_id).waits()]


def _kept_signals(client: Fleet, run_id: str) -> list[tuple[str, str | None]]:
    """(name, consumed_by) of every signal the store keeps for the run."""
    from sqlalchemy import select

    from fleet.store.schema import signals

    with client.runtime.db.engine.connect() as conn:
        rows = conn.execute(
            select(signals.c.name, signals.c.consumed_by)
            .where(signals.c.run_id == run_id)
            .order_by(signals.c.id)
        ).all()
    return [(r.name, r.consumed_by) for r in rows]


def _at_gate(client: Fleet, run_id: str, wait_id: str) -> None:
    poll(
        lambda: (
            _open_waits(client, run_id) == [wait_id] and client.run(run_id).status() == "waiting"
        ),
        60,
        f"run {run_id} to wait at {wait_id}",
    )


def test_a_decision_sent_twice_answers_its_wait_and_never_the_next(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("two_gates")
    _at_gate(client, run.id, "wait:approval#1")
    (wait,) = run.waits()
    assert (wait.name, wait.timeout_at) == ("approval", None) and wait.since > 0

    client.signal(run.id, "approval", APPROVE, wait_id=wait.id, by="ada")
    with pytest.raises(WaitNotOpen, match="no open wait 'wait:approval#1' on signal 'approval'"):
        client.signal(run.id, "approval", APPROVE, wait_id=wait.id, by="ada")

    _at_gate(client, run.id, "wait:approval#2")
    assert _kept_signals(client, run.id) == [("approval", "wait:approval#1")], (
        "the refused copy left nothing a later wait could consume"
    )
    with pytest.raises(WaitNotOpen):  # the next wait's id, but another signal's name
        client.signal(run.id, "other", APPROVE, wait_id="wait:approval#2")
    client.signal(run.id, "approval", {"approved": False}, wait_id="wait:approval#2")
    assert run.wait(timeout=60) == [APPROVE, {"approved": False}]
    with pytest.raises(WaitNotOpen):  # the run has ended
        client.signal(run.id, "approval", APPROVE, wait_id="wait:approval#2")


def test_concurrent_copies_of_one_decision_land_exactly_once(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """Racing submissions, repeated: each round exactly one lands and the run stops at
    its second gate with nothing left for it."""
    cluster.worker("w1")
    for round_ in range(3):
        run = client.enqueue("two_gates", run_id=f"race-{round_}")
        _at_gate(client, run.id, "wait:approval#1")
        decide = functools.partial(
            client.signal, run.id, "approval", APPROVE, wait_id="wait:approval#1", by="ada"
        )
        outcomes = [
            "refused" if isinstance(r, WaitNotOpen) else "sent" if r is None else repr(r)
            for r in together(6, decide)
        ]
        assert sorted(outcomes) == ["refused"] * 5 + ["sent"], outcomes
        _at_gate(client, run.id, "wait:approval#2")
        assert _kept_signals(client, run.id) == [("approval", "wait:approval#1")]
        second = client.runtime.queries.step(run.id, "wait:approval#2")
        assert second is not None and second.status == StepStatus.PENDING


def test_the_cli_shows_each_open_wait_and_answers_one_by_its_id(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("approval", 3600.0, run_id="gate-cli")
    _at_gate(client, run.id, "wait:approval#1")

    shown = fleet_cli(backend, "status", run.id)
    assert shown.returncode == 0, shown.stderr
    assert "open waits" in shown.stdout and "wait:approval#1" in shown.stdout
    command = "fleet signal gate-cli approval --wait-id 'wait:approval#1' --data JSON"
    assert command in " ".join(shown.stdout.split()), shown.stdout
    document: dict[str, Any] = json.loads(fleet_cli(backend, "status", run.id, "--json").stdout)
    (wait,) = document["waits"]
    assert wait["id"] == "wait:approval#1" and wait["signal"] == "approval"
    assert wait["timeout_at"] == pytest.approx(wait["since"] + 3600.0, abs=5)

    args = [
        "signal",
        run.id,
        "approval",
        "--wait-id",
        "wait:approval#1",
        "--data",
        '{"approved": true}',
    ]
    sent = fleet_cli(backend, *args)
    assert sent.returncode == 0 and "sent to wait wait:approval#1" in sent.stdout, sent.stderr
    one_line_error(fleet_cli(backend, *args), "no open wait 'wait:approval#1'", "nothing was sent")
    assert run.wait(timeout=60) == {"decision": {"approved": True}}
    assert json.loads(fleet_cli(backend, "status", run.id, "--json").stdout)["waits"] == []
