"""kombu transports hardened against poison messages, registered under their own
URL schemes: ``fleetfs://`` (the embedded default) and ``fleetredis://`` (what a
``redis://`` broker URL becomes). kombu's own crash the whole worker ("Unrecoverable
error: JSONDecodeError") on one message that is not JSON; these drop it with an error
line naming it, and the sweeper re-derives from the store whatever it carried.

The filesystem transport also had a race: kombu's own writes a message by creating
its file in the queue folder and then filling it, and reads by moving any file it
finds there, so a reader that comes between the two moves an empty file and the worker
dies on ``JSONDecodeError`` (seen in the demo, where a worker is SIGKILLed while others
publish). Here a message is written to a side folder and renamed into the queue
(atomic on one filesystem); a file that still cannot be read is set aside in
``malformed/``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, filesystem, redis
from kombu.utils.json import dumps, loads

log = logging.getLogger("fleet.broker")

FS_ALIAS = "fleetfs"
REDIS_ALIAS = "fleetredis"


class FilesystemChannel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        staging = Path(self.data_folder_out).parent / "staging"
        staging.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=staging, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(tmp, os.path.join(self.data_folder_out, name))
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        wanted = f"{queue}.msg"
        for filename in sorted(os.listdir(self.data_folder_in)):
            if filename.partition(".")[2] != wanted:
                continue
            processed = self.processed_folder if self.store_processed else tempfile.gettempdir()
            try:
                shutil.move(os.path.join(self.data_folder_in, filename), processed)
            except OSError:
                continue  # another consumer took it first
            path = os.path.join(processed, filename)
            try:
                with open(path, "rb") as f:
                    payload = f.read()
                message = loads(payload.decode())
            except (OSError, ValueError) as exc:
                self._set_aside(path, exc)
                continue
            if not self.store_processed:
                os.remove(path)
            return message
        raise Empty()

    def _set_aside(self, path: str, exc: Exception) -> None:
        bad = Path(self.data_folder_in).parent / "malformed"
        bad.mkdir(exist_ok=True)
        log.error("malformed broker message %s set aside in %s: %s", path, bad, exc)
        try:
            shutil.move(path, bad)
        except OSError:
            Path(path).unlink(missing_ok=True)


class FilesystemTransport(filesystem.Transport):
    Channel = FilesystemChannel


class RedisChannel(redis.Channel):
    # The item is already popped when decoding fails inside kombu: catching the error
    # here drops that one message; the loop goes on with the next.
    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError
            log.error("malformed broker message dropped from Redis: %s", exc)
            raise Empty() from None

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        try:
            return super()._get(queue)
        except ValueError as exc:
            log.error("malformed broker message dropped from Redis queue %s: %s", queue, exc)
            raise Empty() from None


class RedisTransport(redis.Transport):
    Channel = RedisChannel


def register() -> None:
    TRANSPORT_ALIASES.setdefault(FS_ALIAS, f"{__name__}:FilesystemTransport")
    TRANSPORT_ALIASES.setdefault(REDIS_ALIAS, f"{__name__}:RedisTransport")


def broker_url(url: str) -> str:
    """The URL Celery gets: redis:// routed through the hardened transport."""
    register()
    if url.startswith("redis://"):
        return REDIS_ALIAS + url[len("redis") :]
    return url
