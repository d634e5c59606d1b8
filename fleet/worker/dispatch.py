"""Wake-ups sent to the broker. They carry ids only, and a failure to send is never
fatal: the store already records what the message would have said, and the sweeper
re-derives it.

A message's shadow name (what Flower and Celery's logs call the task, and the ``task``
label of Flower's Prometheus series) never holds an id: ``advance:<queue>`` for a run's
wake-up (the queue names the workflow and its version) and ``<workflow>.<step name>``
for a step (``replay.step_shadow``). One series per run or step id would grow without
bound; the ids travel in the message's arguments, where Flower shows them too.
"""

from __future__ import annotations

import logging

from celery import Celery

log = logging.getLogger("fleet.dispatch")

ADVANCE = "fleet.advance"
EXECUTE = "fleet.execute"


def advance_shadow(queue: str) -> str:
    """The name a run's wake-up shows in Flower: ``advance:fleet.research.v1``."""
    return f"advance:{queue}"


class Dispatcher:
    def __init__(self, celery: Celery) -> None:
        self.celery = celery

    def advance(self, run_id: str, queue: str) -> bool:
        return self._send(ADVANCE, [run_id], queue, shadow=advance_shadow(queue))

    def execute(
        self, run_id: str, step_id: str, queue: str, *, shadow: str, countdown: float | None = None
    ) -> bool:
        return self._send(EXECUTE, [run_id, step_id], queue, shadow=shadow, countdown=countdown)

    def _send(
        self,
        task: str,
        args: list[str],
        queue: str,
        *,
        shadow: str,
        countdown: float | None = None,
    ) -> bool:
        try:
            self.celery.send_task(
                task, args=args, queue=queue, shadow=shadow, countdown=countdown, ignore_result=True
            )
            return True
        except Exception as exc:  # broker down, connection reset: the sweeper re-sends
            log.warning(
                "could not send %s%s to queue %s (%s); the sweeper will re-send it",
                task,
                args,
                queue,
                exc,
            )
            return False
