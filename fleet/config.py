"""One typed settings object, built once from the environment at the edge."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fleet.durations import env_duration
from fleet.errors import BadInput
from fleet.registry import check_queue_part

DEFAULT_HOME = ".fleet"
LOG_FORMATS = ("text", "json")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"{name}={raw!r} is not a number") from None
    # NaN passes every comparison's "else" and infinity breaks int(): both are refused,
    # and past 1e9 (seconds: 31 years; bytes: Postgres's largest value) a timer overflows.
    if not math.isfinite(value) or value <= 0 or value > 1e9:
        raise BadInput(f"{name}={raw!r} must be a positive finite number, at most 1e9")
    return value


def _off_or_float(env: Mapping[str, str], name: str, default: float) -> float:
    """``0`` (off) or a positive finite number."""
    raw = env.get(name)
    if raw is not None and raw.strip() in ("0", "0.0"):
        return 0.0
    try:
        return _float(env, name, default)
    except BadInput:
        raise BadInput(f"{name}={raw!r} must be 0 (off) or a positive number") from None


def _count(env: Mapping[str, str], name: str, default: int, least: int = 1) -> int:
    """A whole number of ``least`` or more (``10000``, not ``1e4`` or ``10.5``)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) < least:
        raise BadInput(f"{name}={raw!r} must be a whole number of {least} or more")
    return int(text)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``1``/``0`` (or ``true``/``false``, ``yes``/``no``, ``on``/``off``)."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise BadInput(f"{name}={raw!r} must be 1 or 0")


def _gc_threshold(env: Mapping[str, str], default: tuple[int, int, int] | None) -> Any:
    """``FLEET_GC_THRESHOLD``: three whole numbers (``5000,20,100``, gc.set_threshold's),
    the first at least 1, or ``python`` for the interpreter's own thresholds."""
    raw = env.get("FLEET_GC_THRESHOLD")
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() == "python":
        return None
    parts = [p.strip() for p in raw.split(",")]
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts) or int(parts[0]) < 1:
        raise BadInput(
            f"FLEET_GC_THRESHOLD={raw!r} must be three whole numbers like 5000,20,100 "
            "(the first at least 1), or python"
        )
    return tuple(int(p) for p in parts)


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    """One of ``allowed`` (any case; the first when unset), or one line naming them."""
    raw = (env.get(name) or "").strip()
    if raw.lower() not in ("", *allowed):
        raise BadInput(f"{name}={raw!r} must be one of: {', '.join(allowed)}")
    return raw.lower() or allowed[0]


def _queue(name: str) -> str:
    """``FLEET_QUEUE``: the first part of every queue's name, so one every broker carries
    (see ``fleet.registry.QUEUE_CHARS``); RabbitMQ keeps names starting ``amq.`` for itself."""
    check_queue_part(name, "FLEET_QUEUE", 64)
    if name.startswith("amq."):
        raise BadInput(f"FLEET_QUEUE={name!r} must not start with 'amq.' (RabbitMQ's own)")
    return name


@dataclass(frozen=True)
class Settings:
    """Everything fleet reads from the environment, in one place.

    ``database_url`` and ``broker_url`` default to the embedded store: a SQLite file
    and Celery's filesystem transport under ``home`` (``.fleet/``).
    """

    database_url: str = f"sqlite:///{DEFAULT_HOME}/fleet.db"
    broker_url: str = f"filesystem:///{DEFAULT_HOME}/broker"
    lease_seconds: float = 30.0
    sweep_interval: float = 1.0
    # How long a dispatched wake-up may stay unanswered before the sweeper sends it again.
    sweep_grace: float = 5.0
    # Values larger than this are stored once by content hash and referenced.
    max_payload_bytes: int = 256 * 1024
    # No recorded value may be larger than this.
    max_blob_bytes: int = 64 * 1024 * 1024
    queue: str = "fleet"
    worker_name: str = ""
    # How the worker, the sweeper and the exporter log: ``text`` or ``json`` (fleet/logs.py).
    log_format: str = "text"
    # After SIGTERM, running steps get this long before their leases are released.
    shutdown_grace: float = 20.0
    # A task that finishes a step runs the run's next step itself, when the replay
    # records exactly one, up to this many steps per task (1: every step is a message).
    inline_steps: int = 50
    # A worker running its tasks as threads or greenlets keeps one store connection per
    # task it runs at once (``--concurrency``), up to this many (Postgres), and 5 more
    # for its own threads, opening none beyond (the default 10 + 5: the most a process
    # held before, kept open): keep (this + 5) x such processes under max_connections.
    db_pool_max: int = 10
    # A threads-pool worker runs up to this many attempts of ``async def`` steps at once
    # off its slots, as greenlets on ``async_strands`` threads (fleet/worker/strands.py):
    # an awaiting step holds no thread. Past it they wait on their slots; 0: always.
    async_awaiting: int = 1000
    async_strands: int = 8
    # On Postgres those attempts run on the event loop's own thread instead, at most
    # ``async_strands`` of them in the store at once (fleet/worker/on_loop.py); 0:
    # on strand threads, as on SQLite.
    async_on_loop: bool = True
    # A worker process logs one line whenever its event loop is held longer than this
    # many seconds (an ``async def`` step blocking it: fleet/worker/watchdog.py); 0: off.
    loop_watchdog: float = 1.0
    # A worker process freezes what its start-up built and collects cycles at these
    # thresholds (fleet/worker/collector.py); None (``python``): the interpreter's own.
    gc_threshold: tuple[int, int, int] | None = (5000, 20, 100)
    # A worker keeps up to this many runs' workflows suspended between their advances
    # (fleet/worker/live.py), so a long run's next step costs no replay of its history;
    # 0: every advance replays from the top. One per run: enough for an async worker's
    # hundreds of runs in flight (below them every advance replays from the top).
    live_runs: int = 1024
    # 0: derived from the lease (see ``visibility_timeout``).
    visibility_timeout_seconds: float = 0.0
    # Redis keeps every delivered message until its task acknowledges it and delivers
    # it again after the visibility timeout (kombu's ack emulation: two more round trips
    # per message through the worker's one consumer thread). fleet's own messages need
    # none of it (the sweeper re-derives a lost one from the store), so it is off unless
    # asked for, for Celery tasks of your own on fleet's app.
    broker_redelivery: bool = False
    # FLEET_RETENTION (``30d``): the sweeper prunes runs finished longer ago than this many
    # seconds (see fleet/retention.py). None: every run is kept forever.
    retention: float | None = None
    # The most branches one wf.map / wf.parallel may start, and steps one run may record:
    # past either the run fails with one line naming the limit (LimitExceeded).
    max_fanout: int = 10_000
    max_steps: int = 100_000
    # The console (``fleet console``): ``user:password[,user2:pw2]`` for HTTP basic, or
    # the header a trusted reverse proxy sets to the user; the secret its forms are
    # signed with (random per process when unset). Never in a repr: they are passwords.
    console_auth: str | None = field(default=None, repr=False)
    console_proxy_header: str | None = None
    # The addresses (IPs or CIDR networks, comma-separated) that header is taken from.
    console_trusted_proxies: str | None = None
    console_secret: str | None = field(default=None, repr=False)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if env is None else env
        settings = cls(
            database_url=env.get("FLEET_DATABASE_URL") or cls.database_url,
            broker_url=env.get("FLEET_BROKER_URL") or cls.broker_url,
            lease_seconds=_float(env, "FLEET_LEASE_SECONDS", cls.lease_seconds),
            sweep_interval=_float(env, "FLEET_SWEEP_INTERVAL", cls.sweep_interval),
            sweep_grace=_float(env, "FLEET_SWEEP_GRACE", cls.sweep_grace),
            max_payload_bytes=int(_float(env, "FLEET_MAX_PAYLOAD_BYTES", cls.max_payload_bytes)),
            max_blob_bytes=int(_float(env, "FLEET_MAX_BLOB_BYTES", cls.max_blob_bytes)),
            queue=_queue(env.get("FLEET_QUEUE") or cls.queue),
            worker_name=env.get("FLEET_WORKER_NAME", ""),
            log_format=_choice(env, "FLEET_LOG_FORMAT", LOG_FORMATS),
            visibility_timeout_seconds=_float(env, "FLEET_VISIBILITY_TIMEOUT", 0.0),
            broker_redelivery=_flag(env, "FLEET_BROKER_REDELIVERY", cls.broker_redelivery),
            shutdown_grace=_float(env, "FLEET_SHUTDOWN_GRACE", cls.shutdown_grace),
            inline_steps=int(_float(env, "FLEET_INLINE_STEPS", cls.inline_steps)),
            db_pool_max=_count(env, "FLEET_DB_POOL_MAX", cls.db_pool_max),
            async_awaiting=_count(env, "FLEET_ASYNC_AWAITING", cls.async_awaiting, least=0),
            async_strands=_count(env, "FLEET_ASYNC_STRANDS", cls.async_strands),
            async_on_loop=_flag(env, "FLEET_ASYNC_ON_LOOP", cls.async_on_loop),
            loop_watchdog=_off_or_float(env, "FLEET_LOOP_WATCHDOG", cls.loop_watchdog),
            live_runs=_count(env, "FLEET_LIVE_RUNS", cls.live_runs, least=0),
            gc_threshold=_gc_threshold(env, cls.gc_threshold),
            retention=env_duration(env, "FLEET_RETENTION"),
            max_fanout=_count(env, "FLEET_MAX_FANOUT", cls.max_fanout),
            max_steps=_count(env, "FLEET_MAX_STEPS", cls.max_steps),
            console_auth=env.get("FLEET_CONSOLE_AUTH") or None,
            console_proxy_header=env.get("FLEET_CONSOLE_PROXY_HEADER") or None,
            console_trusted_proxies=env.get("FLEET_CONSOLE_TRUSTED_PROXIES") or None,
            console_secret=env.get("FLEET_CONSOLE_SECRET") or None,
        )
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def broker_folder(self) -> Path | None:
        """The folder of the filesystem transport, or None for a network broker."""
        if not self.broker_url.startswith("filesystem://"):
            return None
        path = self.broker_url[len("filesystem://") :]
        # Like sqlite URLs: filesystem:///.fleet/broker is relative to the working
        # directory, filesystem:////var/fleet/broker is absolute.
        if path.startswith("//"):
            return Path(path[1:])
        return Path(path.lstrip("/") or f"{DEFAULT_HOME}/broker")

    @property
    def visibility_timeout(self) -> float:
        """How long Redis keeps a delivered, unacknowledged message before redelivering it.

        Far above the lease by default: redelivery by the broker is a slow backstop; the
        sweeper, reading leases from the store, recovers a lost step quickly, and a
        redelivery that comes anyway is dropped by the lease.
        """
        if self.visibility_timeout_seconds:
            return self.visibility_timeout_seconds
        return max(3600.0, self.lease_seconds * 20)
