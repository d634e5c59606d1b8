"""A worker survives any bytes on its queues (issue 13, items 1, 7 and 8).

Raw messages are written straight into the broker (Redis: LPUSH onto the queue list;
filesystem: a file renamed into the queue folder, named as kombu names them), a real
worker process takes them, and each test checks that the worker is still alive and
still runs a workflow to success, that nothing recorded changed, and that each bad
message was set aside exactly once in the store's dead-message list.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from time import monotonic
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from fleet import Fleet
from fleet.store import schema
from fleet.testing import FleetProcess
from tests.harness import REDIS_DB, REDIS_HOST, REDIS_PORT, Backend, Cluster, poll

QUEUE = "fleet"  # the default queue every test worker consumes
RECORDED = (schema.runs, schema.steps, schema.attempts, schema.incidents, schema.dead_letters)
SET_ASIDE = "bad message on queue"


# --- writing raw messages into the broker ------------------------------------------------


def envelope(task: str, args: list[Any], **headers: Any) -> dict[str, Any]:
    """A message as Celery and kombu write one for fleet's task (see the unit test
    of fleet.envelope for one captured from Celery itself)."""
    task_id = str(uuid.uuid4())
    body = [args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    return {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": task,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": repr(args)[:1024],
            "kwargsrepr": "{}",
            "origin": "test",
            "ignore_result": True,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
            **headers,
        },
        "properties": {
            "correlation_id": task_id,
            "reply_to": str(uuid.uuid4()),
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": QUEUE},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }


def with_body(message: dict[str, Any], body: bytes) -> dict[str, Any]:
    return {**message, "body": base64.b64encode(body).decode()}


def raw(message: Any) -> bytes:
    return message if isinstance(message, bytes) else json.dumps(message).encode()


def push(backend: Backend, *messages: bytes) -> None:
    """Put raw bytes on the queue, bypassing kombu, as anyone with broker access can."""
    if backend.kind == "postgres":
        import redis

        client = redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB)
        for message in messages:
            client.lpush(QUEUE, message)
        return
    queue = backend.workdir / "broker" / "queue"
    for message in messages:
        tmp = backend.workdir / f"{uuid.uuid4()}.part"
        tmp.write_bytes(message)
        # Named as kombu names a message file; renamed in whole, as fleet's writer does.
        os.replace(tmp, queue / f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{QUEUE}.msg")


def dead_count(client: Fleet) -> int:
    return client.runtime.queries.dead_message_count()


def recorded(client: Fleet) -> dict[str, list[tuple[Any, ...]]]:
    """Everything the store records about runs, compared before and after."""
    with client.runtime.db.begin() as conn:
        return {
            t.name: sorted(map(tuple, conn.execute(select(t)).all()), key=repr) for t in RECORDED
        }


def assert_still_working(client: Fleet, worker: FleetProcess) -> None:
    assert worker.alive, worker.output()[-3000:]
    run = client.enqueue("chain", 2)
    assert run.wait(timeout=60) == 1, "the worker still runs a workflow"
    assert worker.alive
    assert "Unrecoverable error" not in worker.output()


def set_aside_lines(worker: FleetProcess) -> list[str]:
    return [line for line in worker.output().splitlines() if SET_ASIDE in line]


# --- regressions ----------------------------------------------------------------------


def poisons() -> dict[str, bytes]:
    good = envelope("fleet.advance", ["some-run"])
    return {
        "object body": raw(with_body(good, b'{"a": 1}')),
        "number body": raw(with_body(good, b"5")),
        "bad base64": raw({**good, "body": "%%% not base64 %%%"}),
        "not json": b"\x00not json",
        "empty": b"",
        "kombu decoder object": b'{"__type__": "decimal", "__value__": "nan?"}',
        "unknown task": raw(envelope("celery.chord_unlock", ["x"])),
        "chain header": raw(envelope("fleet.advance", ["x"], chain=[{"task": "celery.ping"}])),
        "number ids": raw(envelope("fleet.execute", [1, None])),
    }


def test_poison_messages_are_set_aside_once_and_the_worker_goes_on(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cases = poisons()
    push(backend, *cases.values())
    before = recorded(client)
    worker = cluster.worker("w1")
    poll(lambda: dead_count(client) == len(cases), 30, "every poison set aside")
    assert recorded(client) == before, "a bad message changed nothing recorded"
    assert len(set_aside_lines(worker)) == len(cases), "one log line per message"
    assert_still_working(client, worker)

    # Acked, not restored: a worker that stops and one that starts see none of them again.
    worker.stop()
    second = cluster.worker("w2")
    assert_still_working(client, second)
    assert dead_count(client) == len(cases)
    assert backend.queued_messages() == 0
    rows = client.dead_messages(limit=100)
    assert len(rows) == len(cases) and all(r.queue == QUEUE and r.reason for r in rows)
    reasons = " | ".join(r.reason for r in rows)
    for expected in ("not [args, kwargs, embed]", "base64", "unexpected header 'chain'"):
        assert expected in reasons, reasons


def test_a_one_megabyte_run_id_is_a_malformed_message_never_written_whole(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    huge = "r" * 1_000_000
    push(backend, raw(envelope("fleet.advance", [huge])))
    push(backend, raw(envelope("fleet.execute", ["run", "s" * 300_000])))
    worker = cluster.worker("w1")
    poll(lambda: dead_count(client) == 2, 30, "both messages set aside")
    assert_still_working(client, worker)
    rows = client.dead_messages()
    assert all(len(r.body.encode()) <= 64 * 1024 for r in rows), "the body is clipped to 64 KiB"
    assert any("1000000 characters" in r.reason for r in rows)
    assert all(len(r.reason) < 1000 for r in rows)
    with client.runtime.db.begin() as conn:
        incidents = conn.execute(select(schema.incidents)).all()
    assert incidents == [], "an over-long id is not an incident: it never reached the engine"
    longest = max(len(line) for line in worker.output().splitlines())
    assert longest < 4000, f"a log line of {longest} characters"


def test_the_broker_folder_deleted_under_a_running_worker(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    if backend.kind != "sqlite":
        pytest.skip("the filesystem transport's folder")
    folder = backend.workdir / "broker"
    for path in (folder, *(p for p in folder.iterdir() if p.is_dir())):
        assert path.stat().st_mode & 0o777 == 0o700, f"{path} is readable by its owner only"
    worker = cluster.worker("w1")
    assert_still_working(client, worker)
    # Moved away in one step, then deleted: a plain rmtree races the worker, which
    # recreates what it needs while the tree is being walked.
    gone = folder.with_name("broker.deleted")
    folder.rename(gone)
    shutil.rmtree(gone)
    poll(lambda: (folder / "queue").is_dir(), 10, "the worker to create the folder again")
    assert folder.stat().st_mode & 0o777 == 0o700
    assert_still_working(client, worker)
    assert "FileNotFoundError" not in worker.output()


def test_entries_of_the_queue_folder_that_are_not_files_are_skipped_once_each(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """A directory, a link and a FIFO named like messages: the worker neither dies, nor
    follows the link, nor moves anything out of the broker folder (issue 48, item 12)."""
    if backend.kind != "sqlite":
        pytest.skip("the filesystem transport's folder")
    queue = backend.workdir / "broker" / "queue"
    secret = backend.workdir / "outside.json"
    secret.write_text(json.dumps(envelope("fleet.advance", ["not-from-the-queue"])))
    entries = {name: queue / f"1_{uuid.uuid4()}.{QUEUE}.msg" for name in ("dir", "link", "fifo")}
    entries["dir"].mkdir()
    entries["link"].symlink_to(secret)
    os.mkfifo(entries["fifo"])
    temp = backend.workdir / "temp"
    temp.mkdir()
    backend.extra_env["TMPDIR"] = str(temp)
    worker = cluster.worker("w1")
    assert_still_working(client, worker)
    assert_still_working(client, worker)  # many polls later: still one line each
    skipped = [line for line in worker.output().splitlines() if "entry" in line]
    for kind, path in (("a directory", "dir"), ("a symbolic link", "link"), ("a FIFO", "fifo")):
        assert sum(entries[path].name in line for line in skipped) == 1, worker.output()[-3000:]
        assert any(f"skipped: {kind}" in line for line in skipped)
        assert os.path.lexists(entries[path]), "left where it was"
    assert len(skipped) == 3
    assert list(temp.iterdir()) == [], "nothing moved through the system's temp folder"
    assert dead_count(client) == 0, "the link's target was never read"
    assert "IsADirectoryError" not in worker.output()


# --- the operator's surface -----------------------------------------------------------


def fleet_cli(backend: Backend, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet", *args],
        env=backend.env(),
        cwd=backend.workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_list_show_and_purge_through_the_cli(backend: Backend, client: Fleet) -> None:
    ledger = client.runtime.ledger
    # Stored values are hostile: markup in the reason, the raw message and its body.
    raw_text = json.dumps(envelope("x", ["[/]y"], origin="[bold]"))
    markup = ledger.set_aside_message(QUEUE, "bad [/] reason [link=http://x]", raw_text)
    other = ledger.set_aside_message("elsewhere", "second", "\x00" + "x" * 100_000)
    kept = next(m for m in client.dead_messages() if m.id == other).body
    assert len(kept) == 64 * 1024 and kept.startswith("\\x00x"), "clipped, NUL escaped"

    listed = fleet_cli(backend, "messages", "list")
    assert listed.returncode == 0, listed.stderr
    assert "bad [/] reason" in listed.stdout and "elsewhere" in listed.stdout

    shown = fleet_cli(backend, "messages", "show", str(markup))
    assert shown.returncode == 0, shown.stderr
    assert "bad [/] reason [link=http://x]" in shown.stdout
    assert '"origin": "[bold]"' in shown.stdout, "the raw message, as text, unwrapped"
    assert '[["[/]y"], {}, {"callbacks": null' in shown.stdout, "its body, decoded"

    # An id past Postgres's integer column, and neither ids nor --all.
    for bad in (("show", "99999999999"), ("purge",)):
        out = fleet_cli(backend, "messages", *bad)
        assert out.returncode == 2, (bad, out.stdout, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr

    purged = fleet_cli(backend, "messages", "purge", str(markup))
    assert purged.returncode == 0 and "1 dead message(s) purged" in purged.stdout
    assert [m.id for m in client.dead_messages()] == [other]
    assert fleet_cli(backend, "messages", "purge", "--all").returncode == 0
    assert dead_count(client) == 0


def test_metrics_count_dead_messages(backend: Backend, client: Fleet) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from fleet.ops.metrics import FleetCollector

    for i in range(3):
        client.runtime.ledger.set_aside_message(QUEUE, f"reason {i}", "body")
    registry = CollectorRegistry()
    registry.register(FleetCollector(client))
    text = generate_latest(registry).decode()
    assert re.search(r"^fleet_dead_messages 3\.0$", text, re.M), text


# --- the property: any bytes, headers and argument shapes ---------------------------------


ids = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
bad_ids = st.one_of(
    st.integers(),
    st.none(),
    st.just(""),
    st.lists(ids, max_size=2),
    ids.map(lambda s: s + "\n"),
    ids.map(lambda s: "\x00" + s),
    st.just("r" * 301),  # over both limits
)
known_headers = set(envelope("fleet.advance", ["x"])["headers"]) | {"redelivered"}


@st.composite
def bad_args(draw: st.DrawFn) -> dict[str, Any]:
    """A fleet task message whose arguments are wrong: count, type, length or shape."""
    task = draw(st.sampled_from(["fleet.advance", "fleet.execute"]))
    arity = 1 if task == "fleet.advance" else 2
    args: list[Any] = draw(st.lists(ids, max_size=4).filter(lambda a: len(a) != arity))
    if draw(st.booleans()):
        args = draw(st.lists(ids, min_size=arity, max_size=arity))
        args[draw(st.integers(0, arity - 1))] = draw(bad_ids)
    message = envelope(task, args)
    body = [args, {}, {}]
    if draw(st.booleans()):  # and a wrong keyword or embed part on top, sometimes
        body[draw(st.sampled_from([1, 2]))] = draw(
            json_values.filter(lambda v: v not in ({}, None))
        )
    return with_body(message, json.dumps(body).encode())


@st.composite
def bad_body(draw: st.DrawFn) -> dict[str, Any]:
    """A fleet envelope whose body is anything but a list of three."""
    value = draw(json_values.filter(lambda v: not (isinstance(v, list) and len(v) == 3)))
    base = envelope(draw(st.sampled_from(["fleet.advance", "fleet.execute"])), ["r", "s"])
    return with_body(base, json.dumps(value).encode())


@st.composite
def bad_headers(draw: st.DrawFn) -> dict[str, Any]:
    """A good body under headers that are wrong: task, id, an unknown or mistyped one."""
    message = envelope("fleet.advance", [draw(ids)])
    headers = message["headers"]
    kind = draw(st.sampled_from(["task", "id", "unknown", "typed", "not a dict"]))
    if kind == "task":
        headers["task"] = draw(json_values.filter(lambda v: v not in ("fleet.advance",)))
    elif kind == "id":
        headers["id"] = draw(st.one_of(st.integers(), st.none(), st.just(""), st.lists(ids)))
    elif kind == "unknown":
        key = draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in known_headers))
        headers[key] = draw(json_values)
    elif kind == "typed":
        key = draw(st.sampled_from(["eta", "timelimit", "retries", "stamps", "ignore_result"]))
        headers[key] = draw(st.sampled_from(["soon", [1, 2], -1, {"a": 1}, "yes"]))
    else:
        message["headers"] = draw(json_values.filter(lambda v: not isinstance(v, dict)))
    return message


@st.composite
def bad_envelope(draw: st.DrawFn) -> Any:
    """The envelope itself wrong: properties, encodings, delivery tag, kombu's typed objects."""
    message = envelope("fleet.advance", ["r"])
    kind = draw(st.sampled_from(["properties", "tag", "encoding", "content", "typed", "base64"]))
    if kind == "properties":
        message["properties"] = draw(json_values.filter(lambda v: not isinstance(v, dict)))
    elif kind == "tag":
        message["properties"]["delivery_tag"] = draw(
            st.one_of(st.integers(), st.none(), st.just(""))
        )
    elif kind == "encoding":
        message["properties"]["body_encoding"] = draw(st.sampled_from([None, "utf-8", "rot13", 5]))
    elif kind == "content":
        message["content-type"] = draw(st.sampled_from(["application/x-python-serialize", None]))
    elif kind == "typed":
        message["headers"]["id"] = {
            "__type__": draw(st.sampled_from(["decimal", "uuid", "datetime", "bytes", "nope"])),
            "__value__": draw(json_values),
        }
    else:
        message["body"] = draw(st.text(max_size=30)) + "!"  # ! is never base64
    return message


any_poison = st.one_of(
    st.binary(max_size=300),
    json_values.map(raw),
    bad_args().map(raw),
    bad_body().map(raw),
    bad_headers().map(raw),
    bad_envelope().map(raw),
    bad_body().map(lambda m: raw(with_body(m, b"\xff\xfe" + b"x"))),  # not UTF-8 inside
)


def test_any_bytes_on_the_queue_leave_the_worker_running(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    worker = cluster.worker("w1")
    assert_still_working(client, worker)

    @settings(
        max_examples=4,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(batch=st.lists(any_poison, min_size=30, max_size=60))
    def each_batch(batch: list[bytes]) -> None:
        before, count = recorded(client), dead_count(client)
        push(backend, *batch)
        poll(lambda: dead_count(client) >= count + len(batch), 60, "the batch set aside")
        assert recorded(client) == before, "nothing recorded changed"
        assert_still_working(client, worker)
        assert dead_count(client) == count + len(batch), "each bad message set aside once"
        assert backend.queued_messages() == 0

    each_batch()
    worker.signal(signal.SIGTERM)
    worker.popen.wait(timeout=30)
    lines = set_aside_lines(worker)
    assert len(lines) == dead_count(client), "one log line per message"
    assert all(len(line) < 1500 for line in lines)
