"""The Celery app a ``Fleet`` sends through and its workers run: its configuration,
and the filesystem transport's folders prepared on first use (never at import).

The rule: everything Celery is told about fleet (late acks, no results, the broker's
set-aside sink) is configured here, once; the tasks themselves are bound in
``fleet.worker.tasks``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery

from fleet.config import Settings
from fleet.errors import BadInput
from fleet.worker import brokers
from fleet.worker.envelope import SINK_OPTION


def broker_folders(folder: Path) -> tuple[Path, Path, Path]:
    """The filesystem transport's folders: messages, messages being taken, bindings."""
    return folder / "queue", folder / "processed", folder / "control"


def prepare_broker(settings: Settings) -> None:
    """Create the filesystem transport's folders (on first use, not at import),
    readable by their owner only: messages name runs and steps."""
    folder = settings.broker_folder
    if folder is None:
        return
    try:
        brokers.create_private_folders(folder, *broker_folders(folder))
    except OSError as exc:
        raise BadInput(f"broker folder {folder} cannot be created: {exc.strerror}") from exc


def make_celery(
    name: str, settings: Settings, set_aside: Callable[[str, str, str], int] | None = None
) -> Celery:
    """The Celery app. ``set_aside(queue, reason, raw) -> id`` keeps a message that is
    not fleet's in the store (``Ledger.set_aside_message``): the broker's channels reach
    it as a transport option (see fleet.worker.brokers)."""
    broker = settings.broker_url
    transport_options: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout}
    if not settings.broker_redelivery:
        # Redis drops a message once delivered: a worker keeps what it took in memory
        # and puts back what it had not started at a warm shutdown; one killed loses it,
        # and the sweeper sends it again from the store (invariant 1), as it did before
        # the visibility timeout (an hour) would have. Without kombu's unacked hash the
        # consumer makes one round trip per message instead of three (bench.async_steps:
        # 500 new runs taken in 1.6-2.3 s instead of 2.7-3.0 s).
        transport_options["ack_emulation"] = False
    if set_aside is not None:
        transport_options[SINK_OPTION] = set_aside
    folder = settings.broker_folder
    if folder is not None:
        queue_dir, processed, control = broker_folders(folder)
        broker = f"{brokers.FS_ALIAS}://"
        transport_options.update(
            data_folder_in=str(queue_dir),
            data_folder_out=str(queue_dir),
            processed_folder=str(processed),
            control_folder=str(control),
            store_processed=False,
            polling_interval=0.05,
        )
    app = Celery(name, broker=brokers.broker_url(broker), set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        task_default_queue=settings.queue,
        task_publish_retry_policy={
            "max_retries": 3,
            "interval_start": 0.1,
            "interval_step": 0.5,
            "interval_max": 1.0,
        },
        worker_hijack_root_logger=False,
        # A prefork child that died holds its pool slot this long before Celery gives
        # up on it (default 10 s); the store already knows the attempt was lost.
        worker_lost_wait=2.0,
        # Celery's default: task events only while something watches them. Flower turns
        # them on when it starts (``enable_events``, flower.cfg); ``fleet worker
        # --task-events`` sends them from the start. Each costs the worker's one consumer
        # thread a round trip to the broker per task and event: with them always on, a
        # worker took about 190 new runs a second here instead of 240 (bench.async_steps).
        worker_send_task_events=False,
        task_send_sent_event=False,
        enable_utc=True,
    )
    return app
