"""Invariant 13: every operator action is a recorded call. ``Fleet``'s steering methods
called with ``by=`` record who, what and why in the transaction of the change (a
failed audit write undoes the change), and a refused action records nothing. Both
stores; the broker is this process's (``inline``), the CLI a real subprocess."""

from __future__ import annotations

import asyncio
import getpass
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError

from fleet import BadInput, Fleet
from fleet.states import StepKind
from fleet.store.audit import Action
from fleet.store.browse import AuditRow, Browse
from fleet.store.ledger import Lease, NewStep
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, InlineBroker


def _audit(client: Fleet, run_id: str | None = None) -> list[AuditRow]:
    return Browse(client.runtime.db).audit(run_id)


def _waiting(client: Fleet, inline: InlineBroker) -> str:
    run = client.enqueue("approval")
    inline.drain(until=lambda: run.status() == "waiting")
    assert run.status() == "waiting"
    return run.id


def test_cancel_records_who_what_and_why_and_a_refused_cancel_records_nothing(
    client: Fleet, inline: InlineBroker
) -> None:
    run_id = _waiting(client, inline)
    before = client.runtime.queries.now()
    assert client.cancel(run_id, "not needed", by="alice", why="customer withdrew")
    (row,) = _audit(client, run_id)
    assert (row.actor, row.action, row.run_id, row.why) == (
        "alice",
        "cancel",
        run_id,
        "customer withdrew",
    )
    assert row.detail == {"reason": "not needed"} and row.at >= before
    # Ended: refused (False), and nothing more is recorded.
    assert not client.cancel(run_id, by="bob", why="again")
    assert [r.actor for r in _audit(client)] == ["alice"]
    # Without by, nothing is recorded (a program's own cancel is not an operator's).
    other = _waiting(client, inline)
    assert client.cancel(other)
    assert _audit(client, other) == []


def test_a_signal_is_recorded_and_one_to_an_ended_run_is_not(
    client: Fleet, inline: InlineBroker
) -> None:
    run_id = _waiting(client, inline)
    client.signal(run_id, "approval", {"approved": True}, by="carol", why="looks right")
    (row,) = _audit(client, run_id)
    assert (row.actor, row.action, row.target, row.why) == (
        "carol",
        "signal",
        "approval",
        "looks right",
    )
    inline.drain()
    assert client.run(run_id).status() == "succeeded"
    with pytest.raises(BadInput, match="a signal can only go to a live run"):
        client.signal(run_id, "approval", {}, by="carol", why="twice")
    assert len(_audit(client, run_id)) == 1


def test_raise_budget_is_recorded_once_and_refused_when_not_parked(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("thrifty")
    inline.drain(until=lambda: run.status() == "needs_decision")
    assert run.status() == "needs_decision"
    client.raise_budget(run.id, cost=1.0, by="dave", why="worth it")
    (row,) = _audit(client, run.id)
    assert (row.action, row.detail, row.why) == ("raise_budget", {"cost": 1.0}, "worth it")
    with pytest.raises(BadInput, match="not waiting on its budget"):
        client.raise_budget(run.id, cost=2.0, by="dave")
    inline.drain()
    assert run.wait(timeout=5) == 3
    assert len(_audit(client, run.id)) == 1


def test_resolve_is_recorded_and_a_step_not_in_doubt_records_nothing(
    client: Fleet, inline: InlineBroker
) -> None:
    """(inline: the advance the resolve sends stays in this process, undelivered.)"""
    # An effect whose worker vanished after acting: recorded by hand, as a replay would.
    ledger, step = client.runtime.ledger, "send_plain#1"
    assert ledger.create_run("doubt", "notify", "1", "{}", '{"args":[],"kwargs":{}}', "fleet")
    assert ledger.start_run("doubt")
    ledger.record_steps("doubt", [NewStep(step, 0, "send_plain", StepKind.TASK, "{}", 1)])
    lease = ledger.take_lease("doubt", step, "gone-worker", 30)
    assert isinstance(lease, Lease) and ledger.park_in_doubt("doubt", step, lease.epoch)
    run = client.run("doubt")
    assert run.status() == "needs_decision"
    with pytest.raises(BadInput, match="not an effect in doubt"):
        client.resolve(run.id, "nope#1", retry=True, by="erin")
    assert _audit(client, run.id) == []
    client.resolve(run.id, step, output={"receipt": "by hand"}, by="erin", why="provider says")
    (row,) = _audit(client, run.id)
    assert (row.action, row.target, row.detail) == ("resolve", step, {"outcome": "happened"})
    with pytest.raises(BadInput, match="not an effect in doubt"):
        client.resolve(run.id, step, retry=True, by="erin")
    assert len(_audit(client, run.id)) == 1


def test_replay_is_recorded_and_a_second_replay_of_the_letter_is_not(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("refusing")
    inline.drain()
    (letter,) = client.dead_letters(run.id)
    client.replay(letter.id, ["now allowed"], by="frank", why="permission granted")
    (row,) = _audit(client, run.id)
    assert (row.action, row.target, row.why) == (
        "replay",
        f"dead letter {letter.id}",
        "permission granted",
    )
    assert row.detail == {"edited_input": True}
    with pytest.raises(BadInput, match="already replayed"):
        client.replay(letter.id, by="frank")
    with pytest.raises(BadInput, match="unknown dead letter"):
        client.replay(10**6, by="frank")
    assert len(_audit(client)) == 1


def test_the_audit_row_is_written_in_the_transaction_of_the_change(
    client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit write that fails takes the change with it: no cancel without its record."""
    run_id = _waiting(client, inline)

    def unwritable(self: Action, run_id: str | None) -> dict[str, Any]:
        return {"b_actor": None, "b_action": None, "b_run": run_id} | dict.fromkeys(
            ("b_target", "b_why", "b_detail")
        )

    monkeypatch.setattr(Action, "params", unwritable)
    with pytest.raises(IntegrityError):
        client.cancel(run_id, by="mallory")
    assert client.run(run_id).status() == "waiting", "the cancel was rolled back with it"
    monkeypatch.undo()
    assert _audit(client) == []


def test_bad_who_or_why_is_refused_before_anything_changes(
    client: Fleet, inline: InlineBroker
) -> None:
    run_id = _waiting(client, inline)
    for kwargs, needle in [
        ({"by": ""}, "by='' must be 1-200 printable characters"),
        ({"by": "x" * 201}, "must be 1-200 printable characters"),
        ({"by": "a\nb"}, "printable"),
        ({"why": "because"}, "pass by= too"),
        ({"by": "alice", "why": "w" * 4001}, "at most 4000 characters"),
    ]:
        with pytest.raises(BadInput, match=needle):
            client.cancel(run_id, **kwargs)
    assert client.run(run_id).status() == "waiting"
    assert _audit(client) == []


def test_the_async_client_passes_who_and_why(client: Fleet, inline: InlineBroker) -> None:
    run_id = _waiting(client, inline)

    async def act() -> bool:
        await client.asignal(run_id, "other", 1, by="grace", why="a nudge")
        return await client.acancel(run_id, "stop", by="grace", why="done with it")

    assert asyncio.run(act())
    assert [(r.action, r.why) for r in _audit(client, run_id)] == [
        ("cancel", "done with it"),
        ("signal", "a nudge"),
    ]


def test_the_cli_acts_as_its_login_name(backend: Backend, client: Fleet) -> None:
    run = client.enqueue("approval", run_id="cli-audit")
    out = fleet_cli(backend, "cancel", run.id, "--reason", "from a shell")
    assert out.returncode == 0, out.stderr
    (row,) = _audit(client, run.id)
    assert (row.actor, row.action, row.why) == (
        f"cli:{getpass.getuser()}",
        "cancel",
        "from a shell",
    )
