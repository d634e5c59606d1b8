"""Flower as deployed: started from the repository's ``flower.cfg`` (the file the image
ships) against a real Redis, next to a real fleet worker. Basic auth is on, the
Prometheus endpoint answers, the worker shows up, and Flower refuses to start at all
when FLOWER_BASIC_AUTH is missing."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

import pytest

from fleet.testing import WORKER_READY, FleetProcess, worker_argv
from tests.harness import APP, REDIS_HOST, REDIS_PORT, ROOT, poll, require_services

FLOWER_CFG = ROOT / "flower.cfg"
REDIS_DB = 14  # not the integration tests' databases (9 and up, one per xdist worker)
USER, PASSWORD = "test", "secret"


def celery_command() -> list[str]:
    script = Path(sys.executable).with_name("celery")
    return [str(script)] if script.exists() else [sys.executable, "-m", "celery"]


def flower_argv(port: int) -> list[str]:
    return [
        *celery_command(),
        "-A",
        f"{APP}:celery_app",
        "flower",
        f"--conf={FLOWER_CFG}",
        f"--port={port}",
    ]


def base_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "FLOWER_", "CELERY_"))
    }
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: str

    def json(self) -> Any:
        return json.loads(self.body)


def get(url: str, auth: tuple[str, str] | None = None) -> Response:
    request = Request(url)
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urlopen(request, timeout=10) as resp:
            return Response(resp.status, dict(resp.headers), resp.read().decode())
    except HTTPError as exc:
        return Response(exc.code, dict(exc.headers), exc.read().decode(errors="replace"))


class Flower:
    """``celery … flower --conf=flower.cfg`` in its own process group."""

    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logdir / "flower.log"
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            flower_argv(self.port),
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30) -> None:
        def up() -> bool:
            if self.popen.poll() is not None:
                pytest.fail(f"flower exited with {self.popen.returncode}:\n{self.output()}")
            try:
                return get(f"{self.url}/healthcheck").status == 200
            except (URLError, ConnectionError, TimeoutError):
                return False

        poll(up, timeout, "flower to answer /healthcheck", interval=0.2)

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        self._out.close()


@dataclass
class Stack:
    flower: Flower
    worker: FleetProcess
    worker_name: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One fleet worker and one Flower on Redis database 14, for the whole module."""
    require_services()
    import redis

    client = redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB)
    client.flushdb()
    workdir = tmp_path_factory.mktemp("flower")
    worker_name = f"flower-e2e-{uuid.uuid4().hex[:8]}"
    env = base_env(
        FLEET_BROKER_URL=f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}",
        FLEET_DATABASE_URL=f"sqlite:///{workdir}/fleet.db",
    )
    migrated = subprocess.run(
        [sys.executable, "-m", "fleet", "db", "upgrade", "-A", APP],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr

    worker = FleetProcess(
        "worker", worker_argv(APP, 1), {**env, "FLEET_WORKER_NAME": worker_name}, workdir
    )
    flower: Flower | None = None
    try:
        if not worker.wait_for_output(WORKER_READY, 30):
            pytest.fail(f"worker did not start:\n{worker.output()}")
        flower = Flower(
            {**env, "FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}", "FLOWER_ADDRESS": "127.0.0.1"},
            workdir,
        )
        flower.wait_ready()
        yield Stack(flower, worker, worker_name, env)
    finally:
        if flower is not None:
            flower.stop()
        worker.signal(signal.SIGKILL)
        worker.stop()
        client.flushdb()
        client.close()


def test_every_page_and_api_call_needs_the_credentials(stack: Stack) -> None:
    url = stack.flower.url
    for path in ("/", "/workers", "/tasks", "/api/workers", "/api/tasks"):
        anonymous = get(url + path)
        assert anonymous.status == 401, (path, anonymous.status)
        wrong = get(url + path, auth=(USER, "not-" + PASSWORD))
        assert wrong.status == 401, (path, wrong.status)
    assert get(url + "/api/workers", auth=(USER, PASSWORD)).status == 200


def test_metrics_are_prometheus_text(stack: Stack) -> None:
    metrics = get(stack.flower.url + "/metrics", auth=(USER, PASSWORD))
    assert metrics.status == 200
    assert metrics.headers.get("Content-Type", "").startswith("text/plain")
    assert "# TYPE flower_events_total counter" in metrics.body
    assert "flower_worker_online" in metrics.body


def test_workers_api_lists_the_running_worker(stack: Stack) -> None:
    def described() -> str | None:
        # A refresh broadcasts one inspect call per figure and keeps the replies that
        # came within Flower's inspect_timeout: a slow reply is missing from one refresh
        # and present in a later one, so poll until the worker is fully described.
        response = get(stack.flower.url + "/api/workers?refresh=1", auth=(USER, PASSWORD))
        if response.status != 200:
            return None
        workers = response.json()
        hostname = next((w for w in workers if w.startswith(stack.worker_name + "@")), None)
        if hostname is None:
            return None
        info = workers[hostname]
        queues = [q["name"] for q in info.get("active_queues") or []]
        return (
            hostname
            if "fleet" in queues and "fleet.execute" in (info.get("registered") or [])
            else None
        )

    hostname = poll(
        described,
        30,
        f"Flower's /api/workers to list {stack.worker_name} with its queues and tasks",
        0.5,
    )

    # The worker's heartbeats reach Flower's events, and its Prometheus gauge says online.
    online = f'flower_worker_online{{worker="{hostname}"}} 1.0'
    poll(
        lambda: online in get(stack.flower.url + "/metrics").body,
        30,
        f"{online!r} on /metrics",
        0.5,
    )


TASK_LABEL = re.compile(r'\btask="([^"]*)"')


def test_metrics_carry_no_series_per_run_or_step_id(stack: Stack) -> None:
    """Issue 13, exposure: task names (Flower's ``task`` label) are shadow names, and
    they used to hold the run id (``advance:<run id>``) and the step id
    (``chain.work#3``): one set of series per run, growing without bound. Now the
    labels name the queue and the step, so more runs add no series."""
    from fleet import Settings
    from tests import flows

    client = flows.fleet.with_settings(Settings.from_env(stack.env))
    marker = uuid.uuid4().hex[:10]
    runs: list[Any] = []

    def settled() -> str | None:
        """Flower's /metrics once it has counted eight step tasks (each run's advance
        ran its first item itself and sent the other two as messages). The worker sends
        task events once Flower has turned them on (``enable_events``): runs that ended
        before then are not counted, so four more run at each look."""
        batch = [
            client.enqueue("fan", 3, run_id=f"metrics-{marker}-{len(runs) + i}") for i in range(4)
        ]
        runs.extend(batch)
        for run in batch:
            assert run.wait(timeout=60)["total"] == 0 + 1 + 4
        body = get(stack.flower.url + "/metrics").body
        runtime = re.search(
            r'flower_task_runtime_seconds_count\{task="fan\.square",[^}]*\} (\d+)', body
        )
        return body if runtime and float(runtime.group(1)) >= 8 else None

    try:
        body = poll(settled, 60, "Flower's /metrics to count the runs' step tasks", 0.5)
    finally:
        client.runtime.db.dispose()
    assert marker not in body, [line for line in body.splitlines() if marker in line][:5]
    tasks = set(TASK_LABEL.findall(body))
    assert "fan.square" in tasks, tasks
    assert not [t for t in tasks if "#" in t], f"a step id in a task label: {tasks}"
    advances = {t for t in tasks if t.startswith("advance:")}
    assert advances == {"advance:fleet.fan.v1"}, advances


@pytest.mark.parametrize(
    ("auth", "needle"),
    [
        (None, "FLOWER_BASIC_AUTH is not set"),
        ("", "FLOWER_BASIC_AUTH is not set"),
        ("no-colon-here", "FLOWER_BASIC_AUTH must be user:password"),
        # Issue 13 item 6: empty entries used to be dropped, so "," left Flower with no
        # credential at all and it served every page openly.
        (",", "FLOWER_BASIC_AUTH must be user:password"),
        (" , ,", "FLOWER_BASIC_AUTH must be user:password"),
        (f"{USER}:{PASSWORD},", "FLOWER_BASIC_AUTH must be user:password"),
        (f":{PASSWORD}", "FLOWER_BASIC_AUTH must be user:password"),
        (f"{USER}:", "FLOWER_BASIC_AUTH must be user:password"),
        (f"{USER}: ", "FLOWER_BASIC_AUTH must be user:password"),
    ],
    ids=[
        "unset",
        "empty",
        "malformed",
        "only-a-comma",
        "only-commas-and-blanks",
        "trailing-comma",
        "empty-user",
        "empty-password",
        "blank-password",
    ],
)
def test_flower_refuses_to_start_without_basic_auth(
    tmp_path: Path, auth: str | None, needle: str
) -> None:
    env = base_env(FLEET_BROKER_URL=f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}")
    if auth is not None:
        env["FLOWER_BASIC_AUTH"] = auth
    result = subprocess.run(
        flower_argv(free_port()),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and needle in lines[-1], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
