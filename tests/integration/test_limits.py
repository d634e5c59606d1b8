"""Fleet-wide limits on real workers (invariant 12): a step starts only when every
limit it names has room, decided across every worker at once; a step waiting for room
holds no worker; a worker killed holding a slot gives it back when its lease lapses; a
provider's 429 closes the limit for everyone; a per-tenant limit holds per tenant."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet import Fleet
from fleet.worker import gate
from tests.harness import Backend, Cluster, poll

APP = "tests.limits_flows"


@pytest.fixture
def lclient(backend: Backend) -> Iterator[Fleet]:
    from tests import limits_flows

    client = limits_flows.fleet.with_settings(backend.settings())
    client.upgrade_schema()
    yield client
    client.runtime.db.dispose()


def calls(backend: Backend) -> list[dict[str, Any]]:
    path = Path(backend.provider_path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def most_at_once(events: list[dict[str, Any]], key: str = "limit") -> dict[str, int]:
    """Per value of ``key``: the most calls inside the stand-in at the same time (an exit
    and an enter at the same instant count the exit first)."""
    inside: dict[str, int] = {}
    most: dict[str, int] = {}
    for e in sorted(events, key=lambda e: (e["t"], e["event"] == "enter")):
        k = str(e[key])
        inside[k] = inside.get(k, 0) + (1 if e["event"] == "enter" else -1)
        most[k] = max(most.get(k, 0), inside[k])
    return most


def _kept_to_two(
    backend: Backend, lclient: Fleet, runs: list[Any], entered: int
) -> list[dict[str, Any]]:
    """Once ``runs`` have ended: ``entered`` calls went into the stand-in, never a third
    at once under the limit "api" of two, and every slot was given back. The calls."""
    for run in runs:
        run.wait(timeout=90)
    events = calls(backend)
    assert sum(e["event"] == "enter" for e in events) == entered
    assert most_at_once(events) == {"api": 2}, "never a third call; two at once do happen"
    use = {u.key: u for u in gate.uses(lclient.runtime)}["api"]
    assert use.running == 0, "every slot was given back"
    return events


def test_two_workers_never_let_a_third_call_into_a_limit_of_two(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=4, app=APP)
    cluster.worker("w2", concurrency=4, app=APP)
    cluster.sweeper()
    # Five runs of two sequential calls (the second would run inline without limits)
    # and one fan-out of four: every call asks for the limit "api" of concurrency 2.
    runs = [lclient.enqueue("one_api", i, 0.3) for i in range(5)]
    runs.append(lclient.enqueue("fan_api", 4, 0.3))
    events = _kept_to_two(backend, lclient, runs, 14)
    assert len({e["pid"] for e in events}) == 2, "both workers took calls"


def test_async_steps_keep_a_limit_across_workers_and_give_their_slots_back(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    # On Postgres the attempts run on each worker's event loop thread, the limiter's
    # calls on a thread of their own (tests/unit/test_on_loop.py); on SQLite on strands.
    cluster.worker("w1", concurrency=2, app=APP)
    cluster.worker("w2", concurrency=2, app=APP)
    cluster.sweeper()
    runs = [lclient.enqueue("aone_api", i, 0.3) for i in range(4)]
    _kept_to_two(backend, lclient, runs, 8)


def test_a_worker_killed_holding_a_slot_gives_it_back_when_its_lease_lapses(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    w1 = cluster.worker("w1", concurrency=2, app=APP)
    w2 = cluster.worker("w2", concurrency=2, app=APP)
    cluster.sweeper()
    first = lclient.enqueue("solo", 0, 60.0)  # its first attempt hangs: killed there
    entered = poll(
        lambda: next((e for e in calls(backend) if e["event"] == "enter"), None),
        30,
        "the first call to enter",
    )
    holder = w1 if entered["pid"] == w1.pid else w2
    holder.signal(signal.SIGKILL)
    killed_at = time.time()
    second = lclient.enqueue("solo", 1, 0.0)
    assert second.wait(timeout=60) == "solo-1"
    assert first.wait(timeout=60) == "solo-0"
    events = calls(backend)
    second_enter = next(e for e in events if e["run"] == second.id and e["event"] == "enter")
    # The slot lapsed (a lease is 2 s, renewed every third of it): not given back at once.
    assert second_enter["t"] > killed_at + 1.0
    lived = [e for e in events if not (e["run"] == first.id and e["attempt"] == 1)]
    assert most_at_once(lived) == {"solo": 1}


def test_a_redis_flush_while_a_slot_is_held_lets_no_second_step_in(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    """Issue 48, item 14: FLUSHDB of the limiter's Redis while "solo" (concurrency 1) is
    held. The held slot is made again from the store's leases before anyone is let in:
    a second run's call starts only once the first has ended."""
    if backend.kind != "postgres":
        pytest.skip("the Redis limiter (the embedded default's limits are in the store)")
    cluster.worker("w1", concurrency=2, app=APP)
    cluster.worker("w2", concurrency=2, app=APP)
    cluster.sweeper()
    first = lclient.enqueue("solo", 0, 4.0)
    poll(lambda: any(e["run"] == first.id for e in calls(backend)), 30, "the first call")
    backend.flush_broker()  # FLUSHDB of the workers' Redis database: the limiter's too
    second = lclient.enqueue("solo", 1, 0.0)
    assert second.wait(timeout=60) == "solo-1"
    assert first.wait(timeout=60) == "solo-0"
    events = calls(backend)
    assert most_at_once(events) == {"solo": 1}, "the two calls never overlapped"
    first_exit = next(e for e in events if e["run"] == first.id and e["event"] == "exit")
    second_enter = next(e for e in events if e["run"] == second.id and e["event"] == "enter")
    assert second_enter["t"] >= first_exit["t"]
    poll(
        lambda: {u.key: u.running for u in gate.uses(lclient.runtime)}.get("solo") == 0,
        10,
        "the restored slot to be given back",
    )


def test_a_429_closes_the_limit_for_every_worker_and_the_step_dies_at_its_cap(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=2, app=APP)
    cluster.worker("w2", concurrency=2, app=APP)
    cluster.sweeper()
    failing = lclient.enqueue("gets_429", 1.5)
    first_429 = poll(
        lambda: next((e for e in calls(backend) if e["run"] == failing.id), None),
        30,
        "the first 429",
    )
    other = lclient.enqueue("busy_one", 7)
    other.wait(timeout=60)
    entered = next(e for e in calls(backend) if e["run"] == other.id and e["event"] == "enter")
    assert entered["t"] >= first_429["t"] + 1.2, "the limit stayed closed for its Retry-After"
    with pytest.raises(Exception, match="429"):
        failing.wait(timeout=60)
    tries = [e for e in calls(backend) if e["run"] == failing.id]
    assert len(tries) == 3, "retried as its policy says, then dead-lettered at its cap"
    assert len(lclient.dead_letters(failing.id)) == 1


def test_a_429_through_the_openai_wrapper_closes_the_steps_rated_limit(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    """The client's 429 with retry-after-ms becomes Retry(limit=) of the step's first
    rated limit ("provider", not the concurrency-only "busy"): paused for everyone."""
    cluster.worker("w1", concurrency=2, app=APP)
    run = lclient.enqueue("llm_429", 40_000)
    with pytest.raises(Exception, match="429"):
        run.wait(timeout=60)
    use = {u.key: u for u in gate.uses(lclient.runtime)}
    assert 25 < use["provider"].paused_for <= 40 and use["busy"].paused_for == 0


def test_a_per_tenant_limit_holds_for_each_tenant_across_workers(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=4, app=APP)
    cluster.worker("w2", concurrency=4, app=APP)
    cluster.sweeper()
    acme = lclient.enqueue("tenant_run", 3, 0.4, tenant="acme")
    zeta = lclient.enqueue("tenant_run", 3, 0.4, tenant="zeta")
    acme.wait(timeout=60)
    zeta.wait(timeout=60)
    events = [dict(e, tenant="acme" if e["run"] == acme.id else "zeta") for e in calls(backend)]
    assert most_at_once(events, key="tenant") == {"acme": 1, "zeta": 1}
    assert most_at_once(events) == {"per-tenant": 2}, "the two tenants did run at once"
    keys = {u.key for u in gate.uses(lclient.runtime)}
    assert {"per-tenant#acme", "per-tenant#zeta"} <= keys


def test_a_step_waiting_for_room_holds_no_worker_slot(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    """One worker with two slots; "solo" (concurrency 1) is held by a long call. A second
    call waits for it, yet a run that names no limit still finds a slot and finishes
    while the long call runs: the waiting call is a countdown message, not a thread."""
    cluster.worker("w1", concurrency=2, app=APP)
    # Held long enough for a CLI process and three runs on a loaded 2-core host.
    long = lclient.enqueue("solo", 0, 10.0)
    poll(lambda: any(e["run"] == long.id for e in calls(backend)), 30, "the long call")
    waiting = lclient.enqueue("solo", 1, 0.0)
    poll(
        lambda: {u.key: u.waiting for u in gate.uses(lclient.runtime)}.get("solo") == 1,
        30,
        "the second call to wait on solo",
    )
    shown = subprocess.run(
        [sys.executable, "-m", "fleet", "status", waiting.id, "-A", APP, "--json"],
        env=backend.env(),
        cwd=backend.workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    on = [s["waiting_on"] for s in json.loads(shown.stdout)["steps"] if s["waiting_on"]]
    assert on == [{"limit": "solo", "why": "concurrency"}], shown.stdout
    free = [lclient.enqueue("free_run", i) for i in range(3)]
    for run in free:
        run.wait(timeout=30)
    long_exit = [e for e in calls(backend) if e["run"] == long.id and e["event"] == "exit"]
    assert long_exit == [], "the free runs finished while the long call still held solo"
    assert waiting.wait(timeout=60) == "solo-1"
    assert long.wait(timeout=60) == "solo-0"


def test_fleet_limits_shows_use_room_and_waiting(backend: Backend, lclient: Fleet) -> None:
    from fleet.limits import Want
    from fleet.worker.limiter import RedisLimits

    lim = gate.limiter(lclient.runtime)
    # On Redis when the broker is Redis; in the store on the embedded default.
    assert isinstance(lim, RedisLimits) == (backend.kind == "postgres")
    # Two slots of "api" taken, and two requests counted in its last minute; a third
    # step waits (for the minute: looking again in 30 s, so it stays counted as waiting).
    one = [Want("api", 2, 2, None)]
    assert lim.acquire(one, "r", "s1", "t1", 30.0, jitter=0.0, cap=30.0) is None
    assert lim.acquire(one, "r", "s2", "t2", 30.0, jitter=0.0, cap=30.0) is None
    rated = [Want("api", None, 2, None)]
    assert lim.acquire(rated, "r", "s3", "t3", 30.0, jitter=0.0, cap=30.0) is not None
    done = subprocess.run(
        [sys.executable, "-m", "fleet", "limits", "-A", APP, "--json"],
        env=backend.env(),
        cwd=backend.workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = {r["limit"]: r for r in json.loads(done.stdout)}
    assert rows["api"]["running"] == 2 and rows["api"]["concurrency_room"] == 0
    assert rows["api"]["requests_last_minute"] == 2 and rows["api"]["waiting"] == 1
    assert rows["solo"]["running"] == 0 and rows["solo"]["concurrency_room"] == 1
    table = subprocess.run(
        [sys.executable, "-m", "fleet", "limits", "-A", APP],
        env=backend.env(),
        cwd=backend.workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0 and "2/2" in table.stdout


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_with_the_brokers_redis_down_limits_says_so_and_shows_the_store(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    """Issue 48, item 6: ``fleet limits`` printed two tracebacks. Now one line says the
    broker is unreachable, the table what the store knows (bounds, and a step holding a
    lease as running), exit 1; ``fleet status`` shows the run with the same line."""
    cluster.worker("w1", concurrency=2, app=APP)
    run = lclient.enqueue("one_api", 0, 60.0)  # holds a slot of "api" (and its lease)
    poll(lambda: [s for s in run.steps() if s.status == "running"], 60, "the call to start")
    down = backend.env(FLEET_BROKER_URL="redis://127.0.0.1:1/0")  # a closed port

    def fleet(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fleet", *args],
            env=down,
            cwd=backend.workdir,
            capture_output=True,
            text=True,
            timeout=120,
        )

    for out in (fleet("limits", "-A", APP, "--json"), fleet("limits", "-A", APP)):
        said = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 1 and len(said) == 1, out.stderr
        assert "broker unreachable" in said[0] and "what the store knows" in said[0]
    rows = {r["limit"]: r for r in json.loads(fleet("limits", "-A", APP, "--json").stdout)}
    assert rows["api"]["running"] == 1 and rows["api"]["concurrency_room"] == 1
    assert rows["api"]["requests_last_minute"] is None and rows["api"]["waiting"] is None
    assert rows["solo"]["running"] == 0
    assert "1/2" in out.stdout
    status = fleet("status", run.id, "-A", APP)
    assert status.returncode == 0, status.stderr
    assert run.id in status.stdout and "broker unreachable" in status.stderr
    assert "Traceback" not in status.stderr


def test_reserved_tokens_are_settled_with_the_usage_reported(
    backend: Backend, lclient: Fleet, cluster: Cluster
) -> None:
    """Each call reserves 60 of 100 tokens a minute and reports 10: were the reservations
    not settled, the second call would wait a minute; settled, all three pass at once."""
    cluster.worker("w1", concurrency=2, app=APP)
    run = lclient.enqueue("spend_three", 60, 10)
    assert run.wait(timeout=30) == 30
    use = {u.key: u for u in gate.uses(lclient.runtime)}["tokens"]
    assert use.tokens == 30 and use.requests == 3
