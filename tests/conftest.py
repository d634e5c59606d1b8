from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import mutants

# FLEET_MUTANT=NAME runs the tests on a planted bug (tests/chaos/mutants.py): its copy of
# fleet goes first on sys.path before anything imports fleet, and the workers' too.
mutants.plant_from_env()

from fleet import Fleet  # noqa: E402
from tests.harness import Backend, Cluster, InlineBroker, backend_while, client_for  # noqa: E402

# pytest-xdist gives its workers COLUMNS=80 and LINES=24; the CLI (in process, and in
# the subprocesses that inherit them) would then cut its tables, and the ids in them, to
# 80 columns. Output read by the tests is piped, as in a script: no terminal width.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "mutants: runs tests on a planted bug in a subprocess (test_mutants.py)"
    )


def pytest_report_header() -> str | None:
    return mutants.header()


@pytest.fixture(autouse=True)
def _clean_fleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never read the developer's FLEET_* settings."""
    for key in list(os.environ):
        if key.startswith("FLEET_"):
            monkeypatch.delenv(key)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """The same test on the embedded default and on Postgres + Redis."""
    yield from backend_while(request.param, tmp_path)


@pytest.fixture
def client(backend: Backend) -> Iterator[Fleet]:
    fleet = client_for(backend)
    yield fleet
    fleet.runtime.db.dispose()


@pytest.fixture
def cluster(backend: Backend) -> Iterator[Cluster]:
    c = Cluster(backend)
    yield c
    c.stop()


@pytest.fixture
def inline(client: Fleet, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> InlineBroker:
    """Run steps in this process (replay tests); executions still go to the log."""
    monkeypatch.setenv("FLEET_TEST_LOG", str(backend.log_path))
    return InlineBroker(client)


@pytest.fixture
def recorder(backend: Backend) -> Iterator[Fleet]:
    """The replay flows' Fleet (tests/replay_flows.py) on the backend, its schema made."""
    from tests import replay_flows

    fleet = replay_flows.fleet.with_settings(backend.settings())
    fleet.upgrade_schema()
    yield fleet
    fleet.runtime.db.dispose()
