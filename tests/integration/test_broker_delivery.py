"""Redis drops a message once a worker has taken it (``FLEET_BROKER_REDELIVERY`` off, the
default: no kombu unacked hash): a worker keeps what it took in memory, puts back what it
had not started when it stops warm, and a worker killed with messages in hand loses
them to the sweeper, which sends them again from the store. Real Redis and workers."""

from __future__ import annotations

import signal

import pytest
import redis

from fleet import Fleet
from tests.harness import REDIS_DB, REDIS_HOST, REDIS_PORT, Backend, Cluster, poll, starts

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


def _unacked_keys() -> list[bytes]:
    r = redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB)
    return [k for k in r.scan_iter("unacked*")]


def test_a_warm_shutdown_puts_back_a_message_it_held(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """``later`` fails once and is retried in 3 s by a countdown message, held by the
    worker that sent it until due. That worker stops warm before then: the message goes
    back to Redis and the next worker runs the retry. No sweeper runs: nothing else
    could send it."""
    first = cluster.worker("w1")
    run = client.enqueue("retry_later", 3.0)
    poll(lambda: starts(backend, run.id).get("later#1") == 1, 30, "the first attempt")
    step = client.runtime.queries.step(run.id, "later#1")
    poll(
        lambda: (s := client.runtime.queries.step(run.id, "later#1")) and s.status == "retry_wait",
        30,
        "the retry to be due in 3 s",
    )
    assert step is not None
    first.signal(signal.SIGTERM)
    poll(lambda: not first.alive, 30, "the first worker to leave")
    assert backend.queued_messages() == 1, "the held countdown message is back on its queue"
    assert _unacked_keys() == [], "Redis kept no unacked copy of anything"
    cluster.worker("w2")
    assert run.wait(timeout=60) == 2
    assert starts(backend, run.id) == {"later#1": 2}


def test_a_killed_worker_s_messages_are_sent_again_from_the_store(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """SIGKILL while the worker holds the retry's countdown message: Redis has no copy,
    and the sweeper sends the step again once it is due (invariant 1)."""
    first = cluster.worker("w1")
    run = client.enqueue("retry_later", 3.0)
    poll(
        lambda: (s := client.runtime.queries.step(run.id, "later#1")) and s.status == "retry_wait",
        30,
        "the retry to be due in 3 s",
    )
    first.signal(signal.SIGKILL)
    poll(lambda: not first.alive, 30, "the worker to die")
    assert backend.queued_messages() == 0 and _unacked_keys() == [], "the message died with it"
    cluster.worker("w2")
    cluster.sweeper()
    assert run.wait(timeout=60) == 2
    assert starts(backend, run.id) == {"later#1": 2}
