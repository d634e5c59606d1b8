"""Hostile input and operator mistakes at the command line (issue 13): values from the
store are printed as text, never markup; a Secret is shown by name; bad options,
settings and arguments are one line and exit 2; a failed worker exits non-zero; the
metrics server listens on loopback unless told otherwise."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet import BadInput, Fleet
from fleet.testing import FleetProcess
from tests import hostile_app
from tests.e2e.test_cli import fleet_cli, one_line_error
from tests.harness import Backend, InlineBroker, poll

MARKUP = hostile_app.MARKUP
# An enqueued run's id has no "/" (child runs' ids do), so the ids carry Rich's opening
# tags only; the closing "[/]" is in the errors and the values.
ID_MARKUP = "[bold]b [link=https:x]y [red]r"
FAILED_RUN = "run" + ID_MARKUP
GOOD_RUN = "ok" + ID_MARKUP


@pytest.fixture
def hostile(backend: Backend) -> Iterator[Fleet]:
    """A store holding a failed and a succeeded run whose ids, workflow name, errors
    and values are markup, one of them a Secret; run in this process."""
    fleet = hostile_app.fleet.with_settings(backend.settings())
    fleet.upgrade_schema()
    broker = InlineBroker(fleet)
    fleet.enqueue(hostile_app.WORKFLOW, MARKUP, run_id=FAILED_RUN)
    fleet.enqueue(hostile_app.WORKFLOW, "succeed", run_id=GOOD_RUN)
    broker.drain()
    yield fleet
    fleet.runtime.db.dispose()


def wide(backend: Backend, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with room for whole cells: what is checked is the text, not the wrapping."""
    return fleet_cli(backend, *args, env=backend.env(COLUMNS="400"))


def test_values_from_the_store_are_text_not_markup(backend: Backend, hostile: Fleet) -> None:
    letter = hostile.dead_letters()[0]
    shown = {
        "runs": (wide(backend, "runs"), 0),
        "status": (wide(backend, "status", FAILED_RUN), 1),
        "watch": (wide(backend, "watch", FAILED_RUN, "--timeout", "5"), 1),
        "dlq list": (wide(backend, "dlq", "list"), 0),
        "dlq show": (wide(backend, "dlq", "show", str(letter.id)), 0),
    }
    for command, (out, code) in shown.items():
        assert out.returncode == code, f"{command}: {out.stdout}{out.stderr}"
        # Rich would have dropped the tags (or crashed on "[/]"): the literal is there.
        literal = ID_MARKUP if command == "runs" else MARKUP  # "runs" shows ids, no errors
        assert literal in out.stdout, f"{command}: {out.stdout}"
    assert hostile_app.WORKFLOW in shown["runs"][0].stdout
    assert FAILED_RUN in shown["status"][0].stdout
    assert "Secret.env('HOSTILE_KEY')" in shown["dlq show"][0].stdout


def test_a_secret_in_a_result_is_shown_by_name_in_json(backend: Backend, hostile: Fleet) -> None:
    out = fleet_cli(backend, "status", GOOD_RUN, "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["id"] == GOOD_RUN
    assert shown["result"] == "Secret.env('HOSTILE_KEY')"


def test_the_error_line_prints_what_was_typed(backend: Backend, hostile: Fleet) -> None:
    typed = "[/]nope [link=http://x]y[/link]\x1b[31m"
    one_line_error(fleet_cli(backend, "status", typed), "[/]nope [link=http://x]y[/link]\\x1b")


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["resolve", "kept", "--raise-budget", "tokens=nan"], {}, ["tokens=nan"]),
        (["resolve", "kept", "--raise-budget", "tokens=inf"], {}, ["tokens=inf"]),
        (["resolve", "kept", "--raise-budget", "cost=nan"], {}, ["cost=nan"]),
        (["dlq", "replay", "--all", "--rate", "nan"], {}, ["--rate", "nan"]),
        (["sweeper", "--interval", "0"], {}, ["--interval", "positive"]),
        (["sweeper", "--interval", "-1"], {}, ["--interval", "positive"]),
        (["sweeper", "--interval", "nan"], {}, ["--interval", "positive"]),
        (["worker", "--concurrency", "-1"], {}, ["--concurrency", "-1"]),
        (["worker", "--pool", "bogus"], {}, ["--pool 'bogus'", "threads"]),
        (["worker", "--loglevel", "BOGUS"], {}, ["--loglevel 'BOGUS'", "INFO"]),
        (["metrics", "--port", "-1"], {}, ["--port", "-1"]),
        (["metrics", "--port", "70000"], {}, ["--port", "70000"]),
        (["runs"], {"FLEET_SWEEP_INTERVAL": "nan"}, ["FLEET_SWEEP_INTERVAL", "finite"]),
        (["runs"], {"FLEET_LEASE_SECONDS": "inf"}, ["FLEET_LEASE_SECONDS", "finite"]),
        (
            ["runs"],
            {"FLEET_DATABASE_URL": "postgresql+psycopg://u:hunter2@127.0.0.1:port/db"},
            ["database URL", "cannot be parsed"],
        ),
        (["runs"], {"FLEET_DATABASE_URL": "nosuchdb://x/y"}, ["nosuchdb"]),
        # Issue 48: refused at start-up, naming the values allowed, by every command.
        (["runs"], {"FLEET_LOG_FORMAT": "xml"}, ["FLEET_LOG_FORMAT='xml'", "text, json"]),
        (["sweeper"], {"FLEET_LOG_FORMAT": "xml"}, ["FLEET_LOG_FORMAT='xml'", "text, json"]),
        (["dlq", "replay", "--all", "--rate", "0.0000001"], {}, ["--rate", "0.01 and 1000"]),
        (["dlq", "replay", "--all", "--rate", "1e9"], {}, ["--rate", "0.01 and 1000"]),
        (["watch", "kept", "--timeout", "nan"], {}, ["--timeout", "nan"]),
        (["watch", "kept", "--timeout", "inf"], {}, ["--timeout", "inf"]),
        (["watch", "kept", "--timeout", "-1"], {}, ["--timeout", "-1"]),
        (["enqueue", "chain", "1"], {}, ["no app loaded", "-A APP", "workflow 'chain'"]),
        (["limits"], {}, ["no app loaded", "-A APP", "fleet.limit"]),
        (["worker", "--concurrency", "99999999999999999999"], {}, ["--concurrency", "10000"]),
        (["worker", "--queues", "fleet,a b"], {}, ["--queues", "'a b'", "A-Z a-z 0-9 . _ -"]),
        (["worker"], {"FLEET_BROKER_URL": "bogus://x"}, ["FLEET_BROKER_URL", "bogus"]),
        (["sweeper"], {"FLEET_BROKER_URL": "redis://u:hunter2@[bad"}, ["FLEET_BROKER_URL"]),
        # Past 1e9 seconds a timer overflows the clock (the sweeper's OverflowError).
        (["sweeper", "--interval", "1e300"], {}, ["--interval", "up to 1e+09"]),
        (["sweeper"], {"FLEET_SWEEP_INTERVAL": "1e300"}, ["FLEET_SWEEP_INTERVAL", "1e9"]),
    ],
)
def test_bad_options_and_settings_are_one_line(
    backend: Backend, client: Fleet, args: list[str], env: dict[str, str], needles: list[str]
) -> None:
    client.enqueue("chain", 1, run_id="kept")
    before = [(r.id, r.status, r.wake_seq) for r in client.runtime.queries.runs()]
    out = fleet_cli(backend, *args, env=backend.env(**env))
    one_line_error(out, *needles)
    assert "hunter2" not in out.stderr
    assert [(r.id, r.status, r.wake_seq) for r in client.runtime.queries.runs()] == before


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["runs", "--limit", "-1"], ["--limit", "-1"]),
        (["enqueue", "-A", "tests.flows", "chain"], ["workflow 'chain'", "argument"]),
        (["enqueue", "-A", "tests.flows", "chain", *"1234567"], ["workflow 'chain'", "argument"]),
        (["signal", "kept", "bad\x01name"], ["signal name 'bad\\x01name'", "printable"]),
    ],
)
def test_bad_arguments_are_one_line_on_both_stores(
    backend: Backend, client: Fleet, args: list[str], needles: list[str]
) -> None:
    client.enqueue("chain", 1, run_id="kept")
    before = [(r.id, r.status, r.wake_seq) for r in client.runtime.queries.runs()]
    one_line_error(fleet_cli(backend, *args), *needles)
    assert [(r.id, r.status, r.wake_seq) for r in client.runtime.queries.runs()] == before


BIG = "99999999999999999999"  # past 64 bits; the store's ids are 32
DEEP = "[" * 30_000 + "]" * 30_000


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["dlq", "show", BIG], ["dead letter id", "2147483647", BIG]),
        (["dlq", "show", "3000000000"], ["dead letter id", "3000000000"]),
        (["dlq", "replay", "3000000000"], ["dead letter id", "3000000000"]),
        (["prune", "--finished-before", "1s", "--batch", BIG], ["--batch", BIG]),
        (["messages", "list", "--limit", BIG], ["--limit", BIG]),
        (["runs", "--limit", BIG], ["--limit", BIG]),
        (
            ["resolve", "kept", "--raise-budget", "tokens=99999999999999999999999"],
            ["--raise-budget tokens", "99999999999999999999999"],  # as typed, not rounded
        ),
        (["enqueue", "-A", "tests.flows", "chain", DEEP], ["argument 1", "levels deep"]),
        (["signal", "kept", "approval", "--data", DEEP], ["--data", "levels deep"]),
        (["dlq", "replay", "1", "--input", DEEP], ["--input", "levels deep"]),
    ],
)
def test_numbers_and_depths_past_what_the_store_keeps_are_one_line(
    backend: Backend, client: Fleet, args: list[str], needles: list[str]
) -> None:
    """Issue 48, item 8: each was a driver's error with a traceback (Postgres's integer
    out of range, SQLite's overflow) or a RecursionError; now one line, nothing changed."""
    client.enqueue("chain", 1, run_id="kept")
    before = [(r.id, r.status, r.wake_seq) for r in client.runtime.queries.runs()]
    one_line_error(fleet_cli(backend, *args), *needles)
    assert [(r.id, r.status, r.wake_seq) for r in client.runtime.queries.runs()] == before


def test_the_api_refuses_what_the_cli_refuses(client: Fleet) -> None:
    """Fleet.enqueue, raise_budget and signal check before anything is recorded."""
    client.enqueue("chain", 1, run_id="kept")
    for budget in ({"cost": float("nan")}, {"tokens": float("inf")}, {"cost": -1}):
        with pytest.raises(BadInput, match="finite"):
            client.enqueue("chain", 1, budget=budget)
    with pytest.raises(BadInput, match="workflow 'chain' cannot be called"):
        client.enqueue("chain")
    with pytest.raises(BadInput, match="workflow 'chain' cannot be called"):
        client.enqueue("chain", 1, nope=2)
    with pytest.raises(BadInput, match="budget tokens must be at most"):
        client.enqueue("chain", 1, budget={"tokens": 10**23})  # was the driver's DataError
    with pytest.raises(BadInput, match="finite"):
        client.raise_budget("kept", cost=float("nan"))
    with pytest.raises(BadInput, match="printable"):
        client.signal("kept", "a\nb")
    assert [r.id for r in client.runtime.queries.runs()] == ["kept"]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_worker_that_cannot_start_exits_non_zero(backend: Backend) -> None:
    """A worker bootstep that raises: Celery's "Unrecoverable error" must reach the
    exit code, so that a supervisor restarting on failure restarts the worker."""
    out = subprocess.run(
        [sys.executable, "-m", "fleet", "worker", "-A", "tests.broken_worker_app"],
        env=backend.env(),
        cwd=backend.workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Unrecoverable error" in out.stdout + out.stderr, out.stdout + out.stderr
    assert out.returncode == 1, out.returncode


def listening_on(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` (from /proc)."""
    found = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_metrics_listens_on_loopback_and_a_port_in_use_is_one_line(
    backend: Backend, client: Fleet
) -> None:
    port = free_port()
    server = FleetProcess(
        "metrics", ["metrics", "--port", str(port)], backend.env(), backend.workdir
    )
    try:
        assert server.wait_for_output("serving /metrics", 60), server.output()
        poll(lambda: listening_on(port), 10, "the metrics server to listen")
        assert listening_on(port) == {"0100007F"}, "127.0.0.1 only, not every interface"
        one_line_error(
            fleet_cli(backend, "metrics", "--port", str(port)),
            f"cannot serve /metrics on 127.0.0.1:{port}",
        )
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_console_on_a_port_in_use_is_one_line(backend: Backend, client: Fleet) -> None:
    """uvicorn logged its own line and exited 3; the port is the operator's to change:
    one line and exit 2, as ``fleet metrics`` says it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(
            fleet_cli(backend, "console", "--no-auth", "--port", str(port)),
            f"cannot listen on 127.0.0.1:{port}",
            "in use",
        )
