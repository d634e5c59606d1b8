"""The Redis channel's one client per connection pool (``RedisChannel.conn_or_acquire``,
``fleet/worker/brokers.py``), on the real Redis: kombu builds a ``redis.Redis`` for
every ack, publish and event; fleet's channel keeps one, and a pool kombu drops after
a connection error gets a new one, which works."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from kombu import Connection, Exchange, Queue

from fleet.worker import brokers
from tests.harness import REDIS_DB, REDIS_HOST, REDIS_PORT, require_services


@pytest.fixture
def channel() -> Iterator[brokers.RedisChannel]:
    require_services()
    url = brokers.broker_url(f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}")
    with Connection(url) as conn:
        chan = conn.default_channel
        assert isinstance(chan, brokers.RedisChannel)
        yield chan


def test_one_client_serves_every_call_of_a_pool(channel: brokers.RedisChannel) -> None:
    with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
        assert first is second
        assert first.connection_pool is channel.pool
    given = object()
    with channel.conn_or_acquire(given) as client:
        assert client is given  # a caller's own client is used as it is


def test_a_dropped_pool_gets_a_new_client_that_works(channel: brokers.RedisChannel) -> None:
    with channel.conn_or_acquire() as before:
        assert before.ping()
    channel._disconnect_pools()  # what kombu does after a connection error
    with channel.conn_or_acquire() as after:
        assert after is not before
        assert after.connection_pool is channel.pool
        assert after.ping()


def test_threads_sharing_the_client_publish_and_ack_every_message(
    channel: brokers.RedisChannel,
) -> None:
    queue = Queue("fleet-test-shared-client", Exchange("fleet-test-shared-client"), "k")
    bound = queue(channel)
    bound.declare()
    bound.purge()
    producer_errors: list[BaseException] = []

    def publish(base: int) -> None:
        try:
            for i in range(50):
                # Each publish goes through conn_or_acquire, on 8 threads at once.
                channel.basic_publish(
                    channel.prepare_message(str(base + i)), "fleet-test-shared-client", "k"
                )
        except BaseException as exc:  # noqa: BLE001 - reported below
            producer_errors.append(exc)

    threads = [threading.Thread(target=publish, args=(n * 100,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not producer_errors
    got, tags = set(), []
    for _ in range(400):
        message = bound.get(no_ack=False)
        assert message is not None
        got.add(message.body.decode())
        tags.append(message.delivery_tag)
        with channel.conn_or_acquire() as client:
            assert client.hexists(channel.unacked_key, message.delivery_tag)
        message.ack()  # QoS.ack: through conn_or_acquire too
    assert got == {str(n * 100 + i) for n in range(8) for i in range(50)}
    assert bound.get() is None
    with channel.conn_or_acquire() as client:
        assert not any(client.hexists(channel.unacked_key, tag) for tag in tags)
    bound.delete()
