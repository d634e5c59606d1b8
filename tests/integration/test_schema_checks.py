"""The store's schema revision against the code's, and which commands may create a
store (issue 13, items 9 and 11): only `fleet db upgrade`, a worker and `enqueue`;
every read or operator command finds the store as it is and says in one line what is
wrong, creating nothing (not the SQLite file, its folder, or the broker folder)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from fleet import Fleet
from fleet.errors import StoreUnavailable
from fleet.store import migrate
from tests import flows
from tests.e2e.test_cli import fleet_cli, one_line_error
from tests.harness import ROOT, Backend


def fresh(backend: Backend) -> Fleet:
    """A new Fleet on the backend: the schema check runs once per Fleet."""
    return flows.fleet.with_settings(backend.settings())


def set_revision(fleet: Fleet, revision: str) -> None:
    with fleet.runtime.db.begin() as conn:
        conn.execute(text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = :r"), {"r": revision})


def test_an_older_store_says_fleet_db_upgrade(backend: Backend) -> None:
    old = fresh(backend)
    migrate.upgrade(old.runtime.db, "0002")
    old.runtime.db.dispose()
    with pytest.raises(
        StoreUnavailable, match=r"revision 0002, this fleet needs .*fleet db upgrade"
    ):
        fresh(backend).run("any")
    one_line_error(fleet_cli(backend, "runs"), "revision 0002", "`fleet db upgrade`")
    starter = fresh(backend)
    if backend.kind == "sqlite":
        # The embedded store upgrades itself where it would be created: enqueue, a worker.
        starter.enqueue("chain", 1, run_id="after-upgrade")
    else:
        with pytest.raises(StoreUnavailable, match="fleet db upgrade"):
            starter.enqueue("chain", 1, run_id="after-upgrade")
        assert fleet_cli(backend, "db", "upgrade").returncode == 0
    assert migrate.current(starter.runtime.db) == migrate.head()
    assert fleet_cli(backend, "runs").returncode == 0


def test_a_store_newer_than_the_code_is_refused(backend: Backend) -> None:
    fleet = fresh(backend)
    fleet.upgrade_schema()
    fleet.enqueue("chain", 1, run_id="kept")
    set_revision(fleet, "9999")
    for call in (lambda f: f.run("kept"), lambda f: f.enqueue("chain", 1), Fleet.upgrade_schema):
        with pytest.raises(StoreUnavailable, match="revision 9999, which this fleet does not know"):
            call(fresh(backend))
    one_line_error(fleet_cli(backend, "status", "kept"), "9999", "does not know")
    one_line_error(fleet_cli(backend, "db", "upgrade"), "9999", "does not know")


def test_the_head_is_read_from_the_migration_scripts() -> None:
    scripts = sorted(p.name for p in (migrate.MIGRATIONS / "versions").glob("[0-9]*.py"))
    assert migrate.head() == scripts[-1].split("_")[0]


def bare_env() -> dict[str, str]:
    """No FLEET_* setting: the embedded default, .fleet/ in the working directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def cli(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet", *args],
        env=env or bare_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args", [["status", "r1"], ["runs"], ["dlq", "list"], ["cancel", "r1"], ["signal", "r1", "go"]]
)
def test_read_commands_in_the_wrong_folder_create_nothing(tmp_path: Path, args: list[str]) -> None:
    one_line_error(cli(tmp_path, *args), ".fleet/fleet.db does not exist", "fleet db upgrade")
    assert list(tmp_path.iterdir()) == []


def test_enqueue_creates_the_embedded_store_for_its_owner_only(tmp_path: Path) -> None:
    out = cli(tmp_path, "enqueue", "-A", "tests.flows", "chain", "1", "--run-id", "r1")
    assert out.returncode == 0, out.stderr
    home = tmp_path / ".fleet"
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "fleet.db").stat().st_mode) == 0o600
    status = cli(tmp_path, "status", "r1")
    assert status.returncode == 0 and "r1" in status.stdout, status.stderr
    for name in ("fleet.db-wal", "fleet.db-shm"):  # SQLite copies the database's mode
        if (home / name).exists():
            assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_foreign_sqlite_file_is_left_as_it_was(tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
    conn.close()
    (tmp_path / "text.db").write_text("this is a text file, not a database at all\n" * 4)
    before = {p.name: digest(p) for p in tmp_path.iterdir()}
    env = bare_env() | {"FLEET_BROKER_URL": f"filesystem:///{tmp_path}/broker"}
    for command in (["runs"], ["status", "r1"]):
        one_line_error(
            cli(tmp_path, *command, env=env | {"FLEET_DATABASE_URL": f"sqlite:///{other}"}),
            "has no fleet schema",
            "fleet db upgrade",
        )
    one_line_error(
        cli(tmp_path, "runs", env=env | {"FLEET_DATABASE_URL": f"sqlite:///{tmp_path}/text.db"}),
        "text.db",
        "file is not a database",
    )
    assert {p.name: digest(p) for p in tmp_path.iterdir()} == before
