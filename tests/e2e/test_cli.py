"""The command line as a user meets it: real subprocesses, exit codes, one-line errors,
and nothing already recorded lost when the input is bad."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fleet import Fleet
from fleet.testing import SWEEPER_READY, FleetProcess, sweeper_argv
from tests.harness import APP, ROOT, Backend, Cluster, InlineBroker


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


def test_help_is_plain_text_one_line_a_command() -> None:
    """Issue 48, item 21: ``fleet --help`` showed a docstring's reStructuredText
    (````fleet demo agent````) and cut a command's summary over two rows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(COLUMNS="200", PYTHONPATH=str(ROOT))
    for args in ([], ["dlq"], ["messages"], ["db"], ["demo"], ["transcript"]):
        out = subprocess.run(
            [sys.executable, "-m", "fleet", *args, "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "``" not in out.stdout and "`" not in out.stdout, out.stdout
        panel = out.stdout.partition("Commands")[2].partition("╰")[0]
        rows = [line.strip().strip("│") for line in panel.splitlines()[1:]]
        # Each row names its command: a row that starts blank continues the last one.
        assert all(row[1:2].strip() for row in rows), out.stdout


def test_status_counts_every_attempt_and_those_since_a_replay(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """Issue 48, item 21: after a dead letter's replay the step showed ``attempts 1``
    beside epoch 2 and two workers. Every attempt is counted, and those since the
    replay reset the count its cap is held to are named."""
    client.enqueue("refusing", run_id="refused")
    inline.drain()
    client.replay(client.dead_letters()[0].id)
    inline.drain()  # the replayed attempt is refused again: dead once more
    table = fleet_cli(backend, "status", "refused")
    assert table.returncode == 1, table.stderr  # the run failed
    assert re.search(r"refuse#1\s*│\s*dead\s*│\s*2 \(1 since replay\)\s*│\s*2\s*│", table.stdout)
    step = json.loads(fleet_cli(backend, "status", "refused", "--json").stdout)["steps"][0]
    assert (step["attempts"], step["attempts_total"], step["epoch"]) == (1, 2, 2)
