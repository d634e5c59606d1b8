"""Queue names (issue 48, item 5): a workflow's name and version make its queue's name,
so each is refused at definition, in one line, unless every supported broker can carry
it (Celery's filesystem transport takes A-Z a-z 0-9 . _ - only; RabbitMQ 255 bytes).
What is allowed runs through a real worker on both brokers; a step's name, which names
no queue, may hold spaces and markup."""

from __future__ import annotations

import pytest

from fleet import BadInput, Fleet, Settings
from tests import odd_names_app
from tests.e2e.test_cli import fleet_cli, one_line_error
from tests.harness import Backend, Cluster, client_for


@pytest.mark.parametrize(
    ("name", "version", "needle"),
    [
        ("my flow", "1", "workflow name 'my flow'"),
        ("wf[/]x", "1", "workflow name 'wf[/]x'"),
        ("naïve", "1", "workflow name 'naïve'"),
        ("a/b", "1", "workflow name 'a/b'"),
        ("w" * 129, "1", "1-128 characters"),
        ("ok", "1 beta", "workflow ok's version '1 beta'"),
        ("ok", "v" * 33, "1-32 characters"),
        ("ok", "", "workflow ok's version ''"),
    ],
)
def test_a_name_no_broker_can_carry_is_refused_at_definition(
    name: str, version: str, needle: str
) -> None:
    app = Fleet("t", settings=Settings(database_url="sqlite:///:memory:"))
    with pytest.raises(BadInput, match="A-Z a-z 0-9 . _ -") as refused:
        app.workflow(name=name, version=version)(lambda wf: None)
    assert needle in str(refused.value) and "\n" not in str(refused.value)
    assert app.registry.workflows == {}


@pytest.mark.parametrize("queue", ["my queue", "q" * 65, "amq.fleet", "fleet/x"])
def test_a_base_queue_no_broker_can_carry_is_refused(queue: str) -> None:
    with pytest.raises(BadInput, match="FLEET_QUEUE"):
        Settings.from_env({"FLEET_QUEUE": queue})


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_worker_of_an_app_with_such_a_name_refuses_in_one_line(backend: Backend) -> None:
    """It used to start and stop on "Invalid exchange name" with a traceback, exit 1."""
    out = fleet_cli(backend, "worker", "-A", "tests.spaced_app")
    one_line_error(out, "workflow name 'my flow'", "A-Z a-z 0-9 . _ -")


def test_every_allowed_character_runs_through_a_worker(backend: Backend, cluster: Cluster) -> None:
    client = client_for(backend)
    try:
        cluster.worker("w1", app="tests.odd_names_app")
        app = odd_names_app.fleet.with_settings(backend.settings())
        run = app.enqueue(odd_names_app.WORKFLOW, 41, run_id="odd-1")
        assert run.wait(timeout=60) == 42
        assert [s.id for s in run.steps()] == [f"{odd_names_app.STEP}#1"]
        row = client.runtime.queries.run("odd-1")
        assert row is not None
        assert row.queue.startswith(f"fleet.{odd_names_app.WORKFLOW}.v{odd_names_app.VERSION}")
    finally:
        client.runtime.db.dispose()
