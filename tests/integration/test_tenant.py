"""A run's tenant: given at enqueue (checked, one line when bad), kept on the run,
inherited by its child runs, kept as first given when the same run id is enqueued
again, and a filter of ``fleet runs``. Both stores."""

from __future__ import annotations

import asyncio

import pytest

from fleet import BadInput, Fleet
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, InlineBroker


def _tenant(client: Fleet, run_id: str) -> str | None:
    row = client.runtime.queries.run(run_id)
    assert row is not None
    return row.tenant


def test_a_run_keeps_its_tenant_and_its_children_inherit_it(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("parent", 3, tenant="acme")
    plain = client.enqueue("chain", 1)
    inline.drain()
    assert run.wait(timeout=5)["child"] == 9
    assert _tenant(client, run.id) == "acme"
    assert _tenant(client, f"{run.id}/kid#1") == "acme", "the child run is its parent's tenant's"
    assert _tenant(client, plain.id) is None


def test_the_same_run_id_again_keeps_the_first_tenant(client: Fleet) -> None:
    client.enqueue("chain", 1, run_id="once", tenant="first")
    again = client.enqueue("chain", 1, run_id="once", tenant="second")
    assert again.id == "once" and _tenant(client, "once") == "first"
    client.enqueue("chain", 1, run_id="none-then-some")
    client.enqueue("chain", 1, run_id="none-then-some", tenant="late")
    assert _tenant(client, "none-then-some") is None


@pytest.mark.parametrize("bad", ["", "x" * 201, "tab\there", "line\nbreak", 7])
def test_a_bad_tenant_is_one_line_and_creates_nothing(client: Fleet, bad: object) -> None:
    with pytest.raises(BadInput, match="must be 1-200 printable characters") as caught:
        client.enqueue("chain", 1, run_id="never", tenant=bad)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
    assert client.runtime.queries.run("never") is None


def test_aenqueue_takes_a_tenant(client: Fleet) -> None:
    handle = asyncio.run(client.aenqueue("chain", 1, tenant="async-co"))
    assert _tenant(client, handle.id) == "async-co"


def test_the_cli_enqueues_for_a_tenant_and_lists_by_tenant(backend: Backend, client: Fleet) -> None:
    out = fleet_cli(
        backend, "enqueue", "-A", "tests.flows", "chain", "1", "--run-id", "t-1", "--tenant", "acme"
    )
    assert out.returncode == 0, out.stderr
    client.enqueue("chain", 1, run_id="t-2", tenant="globex")
    client.enqueue("chain", 1, run_id="t-3")
    assert _tenant(client, "t-1") == "acme"
    listed = fleet_cli(backend, "runs", "--tenant", "acme")
    assert listed.returncode == 0, listed.stderr
    assert "t-1" in listed.stdout and "t-2" not in listed.stdout and "t-3" not in listed.stdout
    bad = fleet_cli(backend, "enqueue", "-A", "tests.flows", "chain", "1", "--tenant", "")
    assert bad.returncode == 2 and "tenant '' must be 1-200 printable characters" in bad.stderr
