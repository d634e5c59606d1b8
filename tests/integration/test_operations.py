"""Operating the fleet: Prometheus figures from the store, JSON logs with run context,
and a worker that shuts down gracefully by releasing the leases it abandons."""

from __future__ import annotations

import json
import signal
import socket
import urllib.request

import pytest

from fleet import Fleet, RunFailed
from fleet.store.ledger import Lease
from fleet.testing import FleetProcess
from fleet.worker.replay import advance
from tests.harness import APP, Backend, Cluster, InlineBroker, find_event, poll, starts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _value(text: str, sample: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None


def test_metrics_come_from_the_store(backend: Backend, client: Fleet, cluster: Cluster) -> None:
    cluster.worker("w1")
    run = client.enqueue("chain", 3)
    assert run.wait(timeout=60) == 5
    port = _free_port()
    exporter = FleetProcess(
        "metrics",
        ["metrics", "--port", str(port), "--address", "127.0.0.1", "-A", APP],
        backend.env(),
        backend.workdir,
    )
    cluster.procs.append(exporter)
    assert exporter.wait_for_output("serving /metrics", 30), exporter.output()
    text = _scrape(port)
    assert _value(text, 'fleet_runs{status="succeeded"}') == 1.0
    assert _value(text, "fleet_steps_started_total") == 3.0
    assert _value(text, "fleet_steps_succeeded_total") == 3.0
    assert _value(text, "fleet_fenced_writes_rejected_total") == 0.0
    assert _value(text, "fleet_step_duration_seconds_count") == 3.0
    assert (
        _value(text, 'fleet_tokens_total{direction="input",model="stand-in",workflow="chain"}')
        == 30.0
    )
    assert _value(text, 'fleet_cost_total{model="stand-in",workflow="chain"}') == 0.003
    assert _value(text, 'fleet_queue_depth{queue="fleet.chain.v1"}') == 0.0


def test_json_logs_carry_the_run_context(backend: Backend, client: Fleet, cluster: Cluster) -> None:
    backend.extra_env["FLEET_LOG_FORMAT"] = "json"
    worker = cluster.worker("w1")
    run = client.enqueue("chain", 2)
    assert run.wait(timeout=60) == 1
    engine = [
        json.loads(line)
        for line in worker.output().splitlines()
        if line.startswith("{") and '"logger": "fleet.attempt"' in line
    ]
    assert engine, worker.output()
    for entry in engine:
        assert entry["run_id"] == run.id and entry["step_id"].startswith("work#")
        assert entry["epoch"] == 1 and entry["attempt"] == 1


def test_sigterm_releases_abandoned_leases_at_the_soft_deadline(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    backend.lease_seconds = 60.0  # a takeover by expiry would take a minute
    # Past the broker's last poll: the leaving worker stops consuming when its warm
    # shutdown begins, but a BRPOP it sent just before waits up to kombu's brpop_timeout
    # (1 s) and would take the step re-sent at a deadline inside that second, as it
    # exits (1 failure in 12 runs with a grace of 1 s; the default grace is 20 s).
    backend.extra_env["FLEET_SHUTDOWN_GRACE"] = "2.5"
    leaving = cluster.worker("w1")
    run = client.enqueue("chain", 2, 0.0, 0, 120.0)  # work#1 holds its first attempt
    poll(lambda: find_event(backend, run.id, "work#1", "start"), 30, "work#1 to start")
    cluster.worker("w2")
    leaving.signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 1, "taken over at once, not after the 60 s lease"
    poll(lambda: not leaving.alive, 30, "the worker to leave")
    assert "lease(s) released" in leaving.output()
    tries = [a for a in client.runtime.queries.attempts(run.id) if a.step_id == "work#1"]
    assert [a.worker.split(":")[0] for a in tries] == ["w1", "w2"]


def test_metrics_count_one_fenced_write_and_one_dead_letter(
    client: Fleet, inline: InlineBroker
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from fleet.ops.metrics import FleetCollector

    refusing = client.enqueue("refusing")  # one dead letter
    inline.drain()
    with pytest.raises(RunFailed):
        refusing.wait(timeout=5)
    # One fenced write: a zombie whose lease expired and was taken over commits late.
    run = client.enqueue("chain", 1)
    advance(client.runtime, run.id)
    ledger = client.runtime.ledger
    zombie = ledger.take_lease(run.id, "work#1", "zombie", 0.05)
    assert isinstance(zombie, Lease)
    poll(
        lambda: isinstance(ledger.take_lease(run.id, "work#1", "fresh", 30), Lease),
        10,
        "the takeover",
    )
    assert not ledger.commit_output(run.id, "work#1", zombie.epoch, "0")

    registry = CollectorRegistry()
    registry.register(FleetCollector(client))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples[("fleet_fenced_writes_rejected_total", ())] == 1
    assert samples[("fleet_steps_dead_lettered_total", ())] == 1
    assert samples[("fleet_dead_letters_outstanding", ())] == 1
    assert samples[("fleet_leases_taken_over_total", ())] == 1
    assert samples[("fleet_runs", (("status", "failed"),))] == 1


def test_sigterm_lets_a_short_step_finish_within_the_deadline(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    backend.extra_env["FLEET_SHUTDOWN_GRACE"] = "15"
    leaving = cluster.worker("w1")
    run = client.enqueue("chain", 1, 0.0, 0, 1.5)  # work#1 takes 1.5 s
    poll(lambda: find_event(backend, run.id, "work#1", "start"), 30, "work#1 to start")
    leaving.signal(signal.SIGTERM)
    poll(lambda: not leaving.alive, 30, "the worker to finish its step and leave")
    assert run.wait(timeout=5) == 0
    assert starts(backend, run.id) == {"work#1": 1}, "finished once, handed over to no one"
    assert "lease(s) released" not in leaving.output()


def test_a_gevent_pool_worker_is_monkey_patched(client: Fleet, cluster: Cluster) -> None:
    """``fleet worker --pool gevent`` patches before anything is imported, as ``celery
    worker`` does: without it one step's ``time.sleep`` holds every greenlet."""
    pytest.importorskip("gevent")
    cluster.worker("green", concurrency=20, pool="gevent")
    run = client.enqueue("probe")
    assert run.wait(timeout=60) == {"time": True, "socket": True}


def test_a_plain_celery_worker_consumes_every_workflow_queue(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """``celery -A app worker`` (CONTRACT.md) with no ``-Q`` takes the per-version
    queues runs are sent to, not only the default one."""
    proc = FleetProcess(
        "plain-celery",
        ["-A", APP, "worker", "--pool", "threads", "--concurrency", "2", "-l", "INFO"],
        backend.env(FLEET_WORKER_NAME="plain"),
        backend.workdir,
        module="celery",
    )
    cluster.procs.append(proc)
    assert proc.wait_for_output("ready.", 60), proc.output()
    run = client.enqueue("chain", 2)
    assert run.wait(timeout=60) == 0 + 1
