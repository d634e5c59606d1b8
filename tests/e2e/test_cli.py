"""The command line as a user meets it: real subprocesses, exit codes, one-line errors,
and nothing already recorded lost when the input is bad."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleet import Fleet
from fleet.testing import SWEEPER_READY, FleetProcess, sweeper_argv
from tests.harness import APP, ROOT, Backend, Cluster


def fleet_cli(
    backend: Backend,
    *args: str,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet", *args],
        env=env or backend.env(),
        cwd=backend.workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_enqueue_status_and_watch(backend: Backend, client: Fleet, cluster: Cluster) -> None:
    cluster.worker("w1")
    out = fleet_cli(backend, "enqueue", "-A", "tests.flows", "chain", "3", "--run-id", "cli-1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cli-1"
    watched = fleet_cli(backend, "watch", "cli-1", "--timeout", "60")
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "succeeded" in watched.stdout
    status = fleet_cli(backend, "status", "cli-1")
    assert status.returncode == 0 and "work#3" in status.stdout and "done" in status.stdout
    runs = fleet_cli(backend, "runs", "--status", "succeeded")
    assert runs.returncode == 0 and "cli-1" in runs.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["enqueue", "-A", "tests.flows", "nope"], ["unknown workflow 'nope'", "chain"]),
        (["enqueue", "-A", "tests.flows", "chain", "{not json"], ["argument 1 is not JSON"]),
        (
            ["enqueue", "-A", "tests.flows", "chain", '"' + "x" * 5000 + '"'],
            ["arguments of workflow chain", "over the 4096-byte payload limit"],
        ),
        (["enqueue", "-A", "tests.nonexistent_module", "chain"], ["cannot import", "nonexistent"]),
        (["status", "no-such-run"], ["unknown run id 'no-such-run'"]),
        (["watch", "no-such-run"], ["unknown run id 'no-such-run'"]),
        (["runs", "--status", "bogus"], ["unknown status 'bogus'"]),
    ],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    backend: Backend, client: Fleet, args: list[str], needles: list[str]
) -> None:
    client.enqueue("chain", 1, run_id="kept")
    before = [(r.id, r.status, r.wake_seq) for r in client.runtime.queries.runs()]
    env = backend.env(FLEET_MAX_BLOB_BYTES="4096")
    one_line_error(fleet_cli(backend, *args, env=env), *needles)
    assert [(r.id, r.status, r.wake_seq) for r in client.runtime.queries.runs()] == before


def test_missing_database_is_named(backend: Backend) -> None:
    if backend.kind == "sqlite":
        # A file where the database's folder should be: it cannot be created.
        (backend.workdir / "blocker").write_text("")
        env = backend.env(FLEET_DATABASE_URL=f"sqlite:///{backend.workdir}/blocker/fleet.db")
        one_line_error(fleet_cli(backend, "runs", env=env), "blocker/fleet.db")
    else:
        env = backend.env(FLEET_DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1/fleet_absent")
        one_line_error(fleet_cli(backend, "runs", env=env), "fleet_absent", "does not exist")


def test_a_server_store_without_schema_says_to_migrate(backend: Backend) -> None:
    if backend.kind == "sqlite":
        pytest.skip("the embedded store creates its schema on first use")
    one_line_error(fleet_cli(backend, "runs"), "no fleet schema", "fleet db upgrade")
    assert fleet_cli(backend, "db", "upgrade").returncode == 0
    assert fleet_cli(backend, "runs").returncode == 0


def test_malformed_messages_are_set_aside_and_counted(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    client.celery.send_task("fleet.execute", args=[1, None], queue="fleet")
    client.celery.send_task("fleet.advance", args=["no-such-run"], queue="fleet")
    # Bytes that are not a message at all, in the broker itself.
    if backend.kind == "sqlite":
        queue = backend.workdir / "broker" / "queue"
        (queue / "0_empty.fleet.msg").write_bytes(b"")
        (queue / "1_garbage.fleet.msg").write_bytes(b"\x00not json")
    else:
        import redis

        from tests.harness import REDIS_DB, REDIS_HOST, REDIS_PORT

        redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB).lpush("fleet", b"\x00not json")
    cluster.worker("w1")
    run = client.enqueue("chain", 2)
    assert run.wait(timeout=60) == 1, "the worker survived the bad messages"
    # The advance of an unknown run is a well-formed message: an incident. The rest never
    # reach a task: each is set aside once as a dead message.
    assert client.runtime.queries.incident_counts().get("malformed_message") == 1
    expected = 3 if backend.kind == "sqlite" else 2
    assert client.runtime.queries.dead_message_count() == expected


def test_the_sweeper_sweeps_at_the_interval_it_is_given(backend: Backend, client: Fleet) -> None:
    """``--interval`` wins over FLEET_SWEEP_INTERVAL (0.2 in the test environment)."""
    proc = FleetProcess(
        "sweeper", [*sweeper_argv(APP), "--interval", "0.35"], backend.env(), backend.workdir
    )
    try:
        assert proc.wait_for_output(SWEEPER_READY, 30), proc.output()
        assert "sweeper started: every 0.35s" in proc.output()
    finally:
        proc.stop()


def test_python_dash_m_fleet_works() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fleet", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0 and "demo" in out.stdout
