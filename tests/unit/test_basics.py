"""Config, codec and registry: no services."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet import BadInput, Fleet, Settings
from fleet.codec import decode, encode, parse_json_arg
from fleet.errors import PayloadError, UnknownWorkflow


def test_settings_default_to_the_embedded_store() -> None:
    s = Settings.from_env({})
    assert s.database_url == "sqlite:///.fleet/fleet.db"
    assert s.broker_folder == Path(".fleet/broker")
    assert s.lease_seconds == 30.0
    assert s.visibility_timeout > s.lease_seconds * 10


def test_settings_from_env_and_absolute_broker_folder() -> None:
    s = Settings.from_env(
        {"FLEET_LEASE_SECONDS": "2.5", "FLEET_BROKER_URL": "filesystem:////var/fleet/broker"}
    )
    assert s.lease_seconds == 2.5
    assert s.broker_folder == Path("/var/fleet/broker")
    assert Settings.from_env({"FLEET_BROKER_URL": "redis://127.0.0.1:6379/0"}).broker_folder is None


@pytest.mark.parametrize("value", ["soon", "-1", "0"])
def test_bad_numbers_name_the_variable(value: str) -> None:
    with pytest.raises(BadInput, match="FLEET_LEASE_SECONDS"):
        Settings.from_env({"FLEET_LEASE_SECONDS": value})


def test_codec_is_strict_json_and_bounded() -> None:
    assert decode(encode({"a": [1, 2.5, "x", None]}, what="v", limit=100)) == {
        "a": [1, 2.5, "x", None]
    }
    with pytest.raises(PayloadError, match="output of s#1 is not JSON-serialisable"):
        encode({1, 2}, what="output of s#1", limit=100)
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        encode(float("nan"), what="v", limit=100)
    with pytest.raises(PayloadError, match="is 12 bytes, over the 10-byte payload limit"):
        encode("x" * 10, what="v", limit=10)
    with pytest.raises(PayloadError, match="argument 2 is not JSON"):
        parse_json_arg("{oops", what="argument 2")


def test_registry_errors_are_clear() -> None:
    app = Fleet("t", settings=Settings(database_url="sqlite:///:memory:"))

    @app.step
    def s(ctx: object) -> int:
        return 1

    @app.workflow(version="2")
    def wf(wf: object) -> None:
        return None

    assert app.registry.workflow("wf").version == "2"
    with pytest.raises(UnknownWorkflow, match="unknown workflow 'nope' \\(registered: wf\\)"):
        app.registry.workflow("nope")
    with pytest.raises(TypeError, match="wf.step"):
        s()
    with pytest.raises(TypeError, match="fleet.enqueue"):
        wf()
    with pytest.raises(BadInput, match="two steps are named 's'"):
        app.step(name="s")(lambda ctx: 2)
    with pytest.raises(BadInput, match="without '#'"):
        app.step(name="a#b")(lambda ctx: 2)


def test_celery_app_is_json_only_and_acks_late() -> None:
    app = Fleet("t", settings=Settings(broker_url="redis://127.0.0.1:6379/0"))
    conf = app.celery.conf
    assert conf.task_serializer == "json" and conf.accept_content == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] >= 3600
    assert {"fleet.advance", "fleet.execute"} <= set(app.celery.tasks)


def test_redis_drops_a_message_once_delivered_unless_redelivery_is_asked_for() -> None:
    """kombu's ack emulation (the unacked hash, redelivery after the visibility timeout)
    only with FLEET_BROKER_REDELIVERY=1; fleet's messages are re-derived by the sweeper."""
    env = {"FLEET_BROKER_URL": "redis://127.0.0.1:6379/0"}
    dropping = Fleet("drops", settings=Settings.from_env(env))
    assert dropping.celery.conf.broker_transport_options["ack_emulation"] is False
    again = Settings.from_env({**env, "FLEET_BROKER_REDELIVERY": "1"})
    assert "ack_emulation" not in dropping.with_settings(again).celery.conf.broker_transport_options
    with pytest.raises(BadInput, match="FLEET_BROKER_REDELIVERY='sometimes' must be 1 or 0"):
        Settings.from_env({**env, "FLEET_BROKER_REDELIVERY": "sometimes"})


def test_two_fleets_in_one_process_keep_their_own_tasks(tmp_path: Path) -> None:
    a = Fleet("a", settings=Settings(database_url=f"sqlite:///{tmp_path}/a.db"))
    b = a.with_settings(Settings(database_url=f"sqlite:///{tmp_path}/b.db"))
    assert a.celery.tasks["fleet.execute"] is not b.celery.tasks["fleet.execute"]
    assert b.registry.steps == a.registry.steps and b.registry is not a.registry


def test_secrets_are_recorded_by_name_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet import NonRetryable, Secret

    text = encode({"key": Secret.env("MAIL_API_KEY")}, what="input of send#1", limit=1000)
    assert text == '{"key":{"$fleet_secret":"MAIL_API_KEY"}}'
    restored = decode(text)["key"]
    assert restored == Secret.env("MAIL_API_KEY")
    monkeypatch.setenv("MAIL_API_KEY", "sk-live-123")
    assert restored.reveal() == "sk-live-123"
    assert "sk-live" not in repr(restored) and "sk-live" not in str(Secret("sk-live-123"))
    monkeypatch.delenv("MAIL_API_KEY")
    with pytest.raises(NonRetryable, match="secret MAIL_API_KEY is not set"):
        restored.reveal()
    with pytest.raises(PayloadError, match="input of send#1 holds a Secret with a literal value"):
        encode(Secret("sk-live-123"), what="input of send#1", limit=1000)
    with pytest.raises(PayloadError, match="not an environment variable name"):
        Secret.env("not a name")
    import pickle

    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(Secret("sk-live-123"))


def test_task_events_are_off_until_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's default: a worker sends task events only once something watching turns
    them on (Flower's ``enable_events``) or ``fleet worker --task-events`` asks."""
    from typer.testing import CliRunner

    from fleet.ops import cli, cli_admin

    app = Fleet("t", settings=Settings(broker_url="redis://127.0.0.1:6379/0"))
    assert app.celery.conf.worker_send_task_events is False
    started: list[list[str]] = []
    monkeypatch.setattr(cli_admin, "run_celery", lambda _fleet, argv: started.append(argv) or 0)
    monkeypatch.setattr(cli_admin, "setup_logging", lambda _level, _fmt: None)
    monkeypatch.setenv("FLEET_DATABASE_URL", f"sqlite:///{tmp_path}/fleet.db")
    monkeypatch.setenv("FLEET_BROKER_URL", f"filesystem:///{tmp_path}/broker")
    for flags, events in (([], False), (["--task-events"], True), (["-E"], True)):
        done = CliRunner().invoke(cli.app, ["worker", "-A", "tests.flows", *flags])
        assert done.exit_code == 0, done.output
        assert ("--task-events" in started[-1]) is events, started[-1]
