"""fleet's filesystem channel on its own (no worker, no services): a message that passes
the envelope check but that Celery cannot take is acked and set aside, not raised;
the broker folder deleted under a consumer or a producer is made again, owner-only."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from fleet import Fleet, Settings


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(
        "brokers",
        settings=Settings(
            database_url=f"sqlite:///{tmp_path}/fleet.db",
            broker_url=f"filesystem:///{tmp_path}/broker",
        ),
    )
    f.upgrade_schema()
    yield f
    f.runtime.db.dispose()


def drain(conn: Connection, callback: Any, timeout: float = 1.0) -> None:
    queue = Queue("fleet", Exchange("fleet"), "fleet")
    # socket.timeout (TimeoutError): nothing (more) to deliver.
    with (
        conn.Consumer(queue, callbacks=[callback], accept=["json"]),
        contextlib.suppress(TimeoutError),
    ):
        conn.drain_events(timeout=timeout)


def test_a_message_celery_cannot_take_is_acked_and_set_aside(fleet: Fleet) -> None:
    assert fleet.runtime.dispatcher.advance("run-1", "fleet")
    seen: list[Any] = []

    def refuse(body: Any, message: Any) -> None:
        seen.append(body)
        raise ValueError("boom")

    with fleet.celery.connection_for_read() as conn:
        drain(conn, refuse)
        qos = conn.default_channel.qos
        assert set(qos._delivered) <= qos._dirty, "nothing left unacked to be restored"
    assert len(seen) == 1
    [dead] = fleet.dead_messages()
    assert dead.queue == "fleet" and "ValueError('boom')" in dead.reason
    assert '"fleet.advance"' in dead.body


def test_a_deleted_broker_folder_is_made_again(fleet: Fleet, tmp_path: Path) -> None:
    folder = tmp_path / "broker"
    got: list[Any] = []
    with fleet.celery.connection_for_read() as conn:
        shutil.rmtree(folder)
        drain(conn, lambda body, message: got.append(body), timeout=0.3)  # consumer side
        assert (folder / "queue").is_dir()
        shutil.rmtree(folder)
        assert fleet.runtime.dispatcher.advance("run-2", "fleet")  # producer side
        drain(conn, lambda body, message: (got.append(body), message.ack()))
    assert [b[0] for b in got] == [["run-2"]]
    for path in (folder, folder / "queue", folder / "staging"):
        assert path.stat().st_mode & 0o777 == 0o700, path
    assert fleet.dead_messages() == []


def test_a_bad_message_the_store_cannot_take_is_logged_and_dropped(
    fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with fleet.runtime.db.begin() as conn:
        conn.exec_driver_sql("DROP TABLE fleet_dead_messages")  # the store refuses the write
    (tmp_path / "broker" / "queue" / "0_x.fleet.msg").write_bytes(b"\x00" + b"junk" * 100_000)
    got: list[Any] = []
    with fleet.celery.connection_for_read() as conn:
        drain(conn, lambda body, message: got.append(body), timeout=0.5)
        drain(conn, lambda body, message: got.append(body), timeout=0.2)  # not redelivered
    assert got == []
    assert list((tmp_path / "broker" / "queue").iterdir()) == []
    [line] = [r.getMessage() for r in caplog.records if "bad message" in r.getMessage()]
    assert "dropped (the store could not take it" in line and len(line) < 1000


def test_a_message_is_taken_within_the_broker_folder_never_through_the_temp_folder(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No system temp folder at all: a message moved through it would be lost.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-temp-folder"))
    assert fleet.runtime.dispatcher.advance("run-3", "fleet")
    got: list[Any] = []
    with fleet.celery.connection_for_read() as conn:
        drain(conn, lambda body, message: (got.append(body), message.ack()))
    assert [b[0] for b in got] == [["run-3"]]
    assert fleet.dead_messages() == []
    assert not (tmp_path / "no-such-temp-folder").exists()
    taken = tmp_path / "broker" / "processed"
    assert taken.stat().st_mode & 0o777 == 0o700 and list(taken.iterdir()) == []
