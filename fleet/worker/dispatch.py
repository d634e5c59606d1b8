"""Wake-ups sent to the broker. They carry ids only, and a failure to send is never
fatal: the store already records what the message would have said, and the sweeper
re-derives it.

The ``Dispatcher`` says what to send; a ``Sender`` delivers it. ``CelerySender`` is the
one a ``Fleet`` uses; ``Dispatcher.use`` swaps it (``fleet.testing.InlineBroker`` keeps
messages in memory and runs them in the test's own process).

A message's shadow name (what Flower and Celery's logs call the task, and the ``task``
label of Flower's Prometheus series) never holds an id: ``advance:<queue>`` for a run's
wake-up (the queue names the workflow and its version) and ``<workflow>.<step name>``
for a step (``replay.step_shadow``). One series per run or step id would grow without
bound; the ids travel in the message's arguments, where Flower shows them too.

The sweeper's re-send of a step whose worker died or lost its lease is urgent: on
Redis it goes to the queue's first priority list and is taken before the routine
backlog, so a crash stalls its run for about a lease, not for as long as the queue
is deep (fleet/worker/sweeper.py says which re-sends are urgent). It is still one
message; it only jumps the line. The filesystem transport has no priorities: there
every message waits its turn.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from celery import Celery
from kombu.exceptions import ChannelError

from fleet.worker import strands

log = logging.getLogger("fleet.dispatch")

ADVANCE = "fleet.advance"
EXECUTE = "fleet.execute"
# kombu's Redis transport keeps a list per priority step (0, 3, 6, 9 by default) and
# takes from the lowest first: routine messages go to step 3, urgent ones to step 0.
URGENT, ROUTINE = 0, 3


def advance_shadow(queue: str) -> str:
    """The name a run's wake-up shows in Flower: ``advance:fleet.research.v1``."""
    return f"advance:{queue}"


@dataclass(frozen=True)
class Message:
    """One wake-up: ``task`` is ``ADVANCE`` (args: run id) or ``EXECUTE`` (run id,
    step id); ``countdown`` delays its delivery by that many seconds; ``urgent``, a
    re-send of the sweeper's, is taken before routine messages where the broker can."""

    task: str
    args: list[str]
    queue: str
    shadow: str
    countdown: float | None = None
    urgent: bool = False


class Sender(Protocol):
    """Delivers a message, or raises: the ``Dispatcher`` logs the failure and goes on
    (the sweeper re-sends what was lost). ``waiting``: how many messages wait on
    ``queues``, not yet taken by any worker (or raises: unknown)."""

    def send(self, message: Message) -> None: ...

    def waiting(self, queues: Sequence[str]) -> int: ...


class CelerySender:
    """Sends through a Celery app's broker connection; with ``producer``, through that
    producer (inside its ``batch()``, what is sent goes out in one round at its end)."""

    def __init__(self, celery: Celery, producer: Any = None) -> None:
        self.celery = celery
        self.producer = producer

    def send(self, message: Message) -> None:
        self.celery.send_task(
            message.task,
            args=message.args,
            queue=message.queue,
            shadow=message.shadow,
            countdown=message.countdown,
            priority=URGENT if message.urgent else ROUTINE,
            ignore_result=True,
            producer=self.producer,
        )

    def waiting(self, queues: Sequence[str]) -> int:
        return sum(queue_depths(self.celery, queues).values())


def queue_depths(celery: Celery, queues: Sequence[str]) -> dict[str, int]:
    """Messages waiting on each of ``queues`` for a worker to take them (0 for a queue
    nobody has declared yet); raises, within about a second, if the broker does not
    answer. Each is the count of a passive declare (``_depth``), which kombu's virtual
    channel makes for both of fleet's transports: ``LLEN`` over the queue's priority
    lists on Redis, the files named for it in the filesystem transport's folder. On a
    connection of the app's producer pool, not a new one: a busy worker asks this for
    its runs twice a second."""
    with celery.pool.acquire(block=True, timeout=1.0) as conn:
        conn.ensure_connection(max_retries=1, timeout=1)
        channel: Any = conn.default_channel
        return {queue: _depth(channel, queue) for queue in queues}


def _depth(channel: Any, queue: str) -> int:
    """The messages on ``queue`` by kombu's public count, a passive declare (on Redis
    two round trips: its lists' EXISTS, then their LLEN); 0 when the broker has no such
    queue (on Redis: none of its lists holds a message)."""
    try:
        return int(channel.queue_declare(queue=queue, passive=True).message_count)
    except ChannelError:
        return 0


class Dispatcher:
    """Sends the engine's wake-ups; each call returns whether the message went out."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender

    def use(self, sender: Sender) -> Sender:
        """Send through ``sender`` from now on; returns the one it replaces."""
        previous, self.sender = self.sender, sender
        return previous

    def advance(self, run_id: str, queue: str, *, urgent: bool = False) -> bool:
        return self._send(Message(ADVANCE, [run_id], queue, advance_shadow(queue), urgent=urgent))

    def execute(
        self,
        run_id: str,
        step_id: str,
        queue: str,
        *,
        shadow: str,
        countdown: float | None = None,
        urgent: bool = False,
    ) -> bool:
        return self._send(Message(EXECUTE, [run_id, step_id], queue, shadow, countdown, urgent))

    def waiting(self, queues: Sequence[str]) -> int | None:
        """Messages waiting on ``queues`` for a worker to take them; None: unknown (the
        broker unreachable)."""
        try:
            return strands.off_the_loop(self.sender.waiting, queues)
        except Exception as exc:  # the caller assumes some wait
            log.warning("could not count the messages on %s (%s)", ", ".join(queues), exc)
            return None

    def _send(self, message: Message) -> bool:
        try:
            # From an attempt on the event loop's thread, on a thread of its own: a
            # broker that does not answer stalls that attempt, not the loop.
            strands.off_the_loop(self.sender.send, message)
            return True
        except Exception as exc:  # broker down, connection reset: the sweeper re-sends
            log.warning(
                "could not send %s%s to queue %s (%s); the sweeper will re-send it",
                message.task,
                message.args,
                message.queue,
                exc,
            )
            return False
