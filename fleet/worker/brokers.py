"""kombu transports hardened against poison messages, registered under their own
URL schemes: ``fleetfs://`` (the embedded default) and ``fleetredis://`` (what a
``redis://`` broker URL becomes).

The rule: a worker survives any bytes on its queues. kombu's own transports, and
Celery behind them, end the whole worker ("Unrecoverable error") on one message that
is not JSON, not base64, or not ``[args, kwargs, embed]``, and the message goes back
to the queue for the next worker to die on. Here every message a consumer receives
passes ``fleet.envelope``'s check before kombu or Celery touch it; one that fails is
never delivered (so never redelivered), is set aside once in the store's dead-message
list (``SINK_OPTION`` in the transport options: ``Ledger.set_aside_message``) and is
logged in one clipped line. The sweeper re-derives from the store whatever it carried.

The filesystem transport also had a race: kombu's own writes a message by creating
its file in the queue folder and then filling it, and reads by moving any file it
finds there, so a reader that comes between the two moves an empty file. Here a
message is written to a side folder and renamed into the queue (atomic on one
filesystem). A consumer takes a message by renaming its file into the taken folder
(``processed``, beside the queue in the same owner-only broker folder: never through
the system's temporary folder), reads it there without following a link, and deletes
it. An entry of the queue folder that is not a regular file (a directory, a link, a
FIFO named like a message) is skipped and logged once, left where it is. Its folders
are created owner-only, and created again if someone deletes them under a running
worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, filesystem, redis
from kombu.utils.json import dumps

from fleet.worker import envelope
from fleet.worker.envelope import one_line

log = logging.getLogger("fleet.broker")

FS_ALIAS = "fleetfs"
REDIS_ALIAS = "fleetredis"

# A file in the queue folder larger than this is not a message fleet sent.
MAX_FILE_BYTES = 16 * 1024 * 1024
# How many skipped entries of the queue folder a channel remembers (so logs once each).
_SKIPPED_REMEMBERED = 1000
_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
}


def create_private_folders(*folders: Path) -> None:
    """Create each folder, and any missing parent, readable by its owner only."""
    for folder in folders:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        for path in reversed(missing):
            path.mkdir(mode=0o700, exist_ok=True)


def _passthrough(connection_errors: Any) -> tuple[type[BaseException], ...]:
    """The errors that are the broker's trouble, not the message's: re-raised, so that
    Celery reconnects. kombu counts KeyError among Redis's connection errors; here it
    would be the message's fault, and re-raising it would have the message restored
    and redelivered."""
    return tuple(e for e in connection_errors if e is not KeyError)


def set_aside(transport_options: Any, queue: str, reason: str, raw: Any) -> None:
    """Keep the message in the store's dead-message list and log one line; if the
    store cannot take it, the line (with the body clipped) is all that is left."""
    text = envelope.as_text(raw)
    sink = transport_options.get(envelope.SINK_OPTION)
    if sink is None:
        outcome = "dropped (no store to set it aside in)"
    else:
        try:
            outcome = f"set aside as dead message {sink(queue, reason, text)}"
        except Exception as exc:  # noqa: BLE001 - the store is down: drop, never crash
            outcome = f"dropped (the store could not take it: {one_line(str(exc), 200)})"
    log.error(
        "bad message on queue %s %s: %s; message: %s",
        one_line(queue, 200),
        outcome,
        one_line(reason, 300),
        one_line(text, 200),
    )


class GuardedTransport:
    """Mixed into both transports: every message is checked before kombu builds its
    ``Message`` (which dies on a bad body) or Celery sees it.

    ``_deliver`` is the virtual transport's one door for a message taken from a queue
    (the polling loop, Redis's BRPOP and fanout reads all go through it): kombu has no
    public hook that sees the raw message first, so it is overridden here, as the
    channels below override ``_get`` and ``_put``."""

    client: Any
    connection_errors: Any

    def _deliver(self, message: Any, queue: Any) -> Any:
        if not queue:  # kombu's own error for a message without a queue
            return super()._deliver(message, queue)  # type: ignore[misc]
        name = str(queue)
        options = self.client.transport_options
        try:
            envelope.check(name, message)
        except Exception as exc:  # noqa: BLE001 - Malformed, or a value it did not foresee
            reason = str(exc) if isinstance(exc, envelope.Malformed) else repr(exc)
            return set_aside(options, name, reason, message)
        try:
            return super()._deliver(message, queue)  # type: ignore[misc]
        except _passthrough(self.connection_errors):
            raise
        except Exception as exc:  # noqa: BLE001 - one message must not end the worker
            return set_aside(options, name, f"Celery could not take it: {exc!r}", message)


class GuardedChannel:
    """Mixed into both channels: a message its consumer's callback (Celery) could not
    take is acked, and raised to the transport, which sets it aside."""

    connection: Any
    qos: Any

    def basic_consume(
        self, queue: Any, no_ack: Any, callback: Any, consumer_tag: Any, **kwargs: Any
    ) -> Any:
        return super().basic_consume(  # type: ignore[misc]
            queue, no_ack, self._acking(callback), consumer_tag, **kwargs
        )

    def _acking(self, callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
        passthrough = _passthrough(self.connection.connection_errors)

        def acking(message: Any) -> Any:
            try:
                return callback(message)
            except passthrough:
                raise  # the broker's trouble, not the message's: Celery reconnects
            except Exception:
                self._ack_if_held(message.delivery_tag)
                raise  # GuardedTransport sets it aside

        return acking

    def _ack_if_held(self, tag: Any) -> None:
        try:
            self.qos.get(tag)  # a message not yet acked, held for this consumer
        except KeyError:
            return
        self.basic_ack(tag)  # type: ignore[attr-defined]

    def set_aside(self, queue: str, reason: str, raw: Any) -> None:
        """``set_aside`` through this channel's transport options."""
        set_aside(self.connection.client.transport_options, queue, reason, raw)


class FilesystemChannel(GuardedChannel, filesystem.Channel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skipped: set[str] = set()  # entries of the queue folder logged as skipped

    def _folders(self) -> list[Path]:
        folders = [Path(self.data_folder_in), Path(self.data_folder_out)]
        folders += [Path(self.control_folder), Path(self.data_folder_out).parent / "staging"]
        folders.append(Path(self.processed_folder))  # where a consumer takes a message
        return folders

    def _recreate(self) -> None:
        """The broker folder was deleted under a running process: make it again."""
        log.warning("broker folder %s is gone: creating it again", Path(self.data_folder_in))
        create_private_folders(*self._folders())

    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        try:
            self._write(queue, payload)
        except FileNotFoundError:
            self._recreate()
            self._write(queue, payload)

    def _write(self, queue: Any, payload: Any) -> None:
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        staging = Path(self.data_folder_out).parent / "staging"
        staging.mkdir(mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=staging, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(tmp, os.path.join(self.data_folder_out, name))
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _size(self, queue: Any) -> int:
        try:
            return int(super()._size(queue))
        except FileNotFoundError:
            self._recreate()
            return 0

    def _purge(self, queue: Any) -> int:
        try:
            return int(super()._purge(queue))
        except FileNotFoundError:
            self._recreate()
            return 0

    def _queue_bind(self, exchange: Any, *meta: Any) -> None:
        if not Path(self.control_folder).exists():
            self._recreate()
        super()._queue_bind(exchange, *meta)

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        wanted = f"{queue}.msg"
        try:
            names = sorted(os.listdir(self.data_folder_in))
        except FileNotFoundError:
            self._recreate()
            raise Empty() from None
        for filename in names:
            if filename.partition(".")[2] != wanted:
                continue
            taken = self._take(filename)
            if taken is None:
                continue
            message = self._read(str(queue), taken)
            if message is not None:
                return message
        raise Empty()

    def _take(self, filename: str) -> Path | None:
        """Move the message file ``filename`` out of the queue into the taken folder (a
        rename within the owner-only broker folder: atomic, so one consumer takes it);
        None if it is not a regular file (skipped, logged once) or was taken first."""
        source = Path(self.data_folder_in) / filename
        try:
            mode = os.lstat(source).st_mode
        except FileNotFoundError:
            return None  # another consumer took it first
        if not stat.S_ISREG(mode):
            self._not_a_file(source, mode)
            return None
        taken = Path(self.processed_folder) / filename
        try:
            os.rename(source, taken)
        except FileNotFoundError:
            if not taken.parent.is_dir():
                self._recreate()  # the message is taken at the next poll
            return None
        except OSError as exc:
            self._not_a_file(source, mode, exc.strerror)
            return None
        return taken

    def _not_a_file(self, path: Path, mode: int, why: str | None = None) -> None:
        """One line per entry of the queue folder that no consumer can take; it is
        left where it is (never followed, never moved elsewhere)."""
        if path.name in self._skipped:
            return
        if len(self._skipped) >= _SKIPPED_REMEMBERED:
            self._skipped.clear()
        self._skipped.add(path.name)
        kind = why or _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        log.error(
            "broker queue folder entry %s skipped: %s, not a message file; left where it is",
            one_line(str(path), 300),
            kind,
        )

    def _read(self, queue: str, path: Path) -> Any:
        """The message in the file this consumer took; None if it was not one (set aside)."""
        try:
            # Never a link followed, nor a FIFO waited on: a regular file, or set aside.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise IsADirectoryError(0, "not a regular file")
                payload = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            self.set_aside(queue, f"unreadable message file ({exc.strerror})", b"")
            return None
        finally:
            if not self.store_processed:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        if len(payload) > MAX_FILE_BYTES:
            self.set_aside(queue, f"message file over {MAX_FILE_BYTES} bytes", payload)
            return None
        try:
            # The standard decoder, not kombu's: kombu's turns {"__type__": …} objects
            # into Python values, and raises more than ValueError on bad ones.
            return json.loads(payload.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            self.set_aside(queue, f"not JSON ({one_line(str(exc), 100)})", payload)
            return None


class FilesystemTransport(GuardedTransport, filesystem.Transport):
    Channel = FilesystemChannel

    @property
    def default_connection_params(self) -> dict[str, Any]:
        # A folder has no host: kombu's virtual transports default to "localhost", and
        # every connection made from the URL (one per pooled producer) logged
        # "No hostname was supplied. Reverting to default 'localhost'" for it.
        return {}


class RedisChannel(GuardedChannel, redis.Channel):
    _shared: Any = None  # the client ``conn_or_acquire`` hands out, for ``pool``

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """A client on this channel's connection pool. kombu builds a new ``redis.Redis``
        at every call (every ack, publish and event), and the constructor (its table of
        response callbacks) was a sixth of a busy worker's consumer thread in py-spy at
        500 concurrent steps. A ``redis.Redis`` is safe to share between threads (each
        command checks a connection out of the pool), so one is kept per pool; a new
        pool (kombu drops its pools on a connection error) gets a new client."""
        if client:
            yield client
            return
        shared = self._shared
        if shared is None or shared.connection_pool is not self.pool:
            shared = self._shared = self._create_client()
        yield shared

    # The item is already popped when decoding fails inside kombu: catching the error
    # here sets that one message aside; the loop goes on with the next. kombu's
    # decoder raises more than ValueError on a bad {"__type__": …} object.
    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)
        except (Empty, *self.connection_errors):
            raise
        except Exception as exc:  # noqa: BLE001 - one message must not end the worker
            # kombu's round-robin moved the queue it popped from to the end of its cycle.
            items = getattr(self._queue_cycle, "items", None) or ["(unknown)"]
            self._undecodable(str(items[-1]), exc)
            raise Empty() from None

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        try:
            return super()._get(queue)
        except (Empty, *self.connection_errors):
            raise
        except Exception as exc:  # noqa: BLE001
            self._undecodable(str(queue), exc)
            raise Empty() from None

    def _undecodable(self, queue: str, exc: Exception) -> None:
        # json's error carries the text it could not read.
        raw = getattr(exc, "doc", None)
        self.set_aside(
            queue,
            f"not a message kombu can decode ({one_line(repr(exc), 120)})",
            raw if isinstance(raw, str) else "",
        )


class RedisTransport(GuardedTransport, redis.Transport):
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
