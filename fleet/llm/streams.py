"""Streamed model calls, recorded: every item of the provider's stream is passed on
unchanged (but a usage-only chunk the caller did not ask for), and what the call spent
is recorded once, when the stream ends: read to its end, closed (the ``with`` forms
close it), failed, or, left open, when its step attempt ends. The provider's count comes
in the stream's last items; a stream that ends before it (closed early, or a provider
that sends none) records what fleet saw: the pieces of output it passed on, as output
tokens, and no input tokens (and marks the attempt's ``Calls`` so the limits' gate does
not settle its reservation below what it reserved).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Protocol

from fleet.llm.sending import Recorder, log


class Seen:
    """What a stream showed so far: the model answering, the provider's count of the
    call's tokens (input, output) once it came, and the pieces of output passed on."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.usage: tuple[int, int] | None = None
        self.pieces = 0


class Reader(Protocol):
    def read(self, item: Any, seen: Seen) -> bool:
        """Note what ``item`` shows in ``seen``; whether the caller is given it."""
        ...


class _Recorded:
    """What the sync and async streams share: the one recording, and the rest of the
    provider's stream object (its ``response``, say) passed through."""

    def __init__(self, inner: Any, reader: Reader, rec: Recorder, model: Any) -> None:
        self._inner, self._reader, self._rec = inner, reader, rec
        self._seen = Seen(model)
        self._done = False
        self._lock = threading.Lock()
        self._calls = rec.calls
        self._calls.opened(self, self._end)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _ending(self) -> tuple[Any, int, int] | None:
        """What to record, the first time the stream ends; None after."""
        with self._lock:
            if self._done:
                return None
            self._done = True
        self._calls.closed(self)
        seen = self._seen
        if seen.usage is not None:
            return (seen.model, *seen.usage)
        self._calls.uncounted = True
        log.warning(
            "a stream of model %s ended before the provider's count of its tokens:"
            " %d output pieces recorded as tokens, input not known",
            seen.model,
            seen.pieces,
        )
        return seen.model, 0, seen.pieces

    def _end(self) -> None:
        ending = self._ending()
        if ending is not None:
            self._rec.record(*ending)


class RecordedStream(_Recorded):
    """A sync stream (``Stream``): iterate it, or use it in a ``with`` block."""

    def __init__(self, inner: Any, reader: Reader, rec: Recorder, model: Any) -> None:
        super().__init__(inner, reader, rec, model)
        self._items = iter(inner)

    def __iter__(self) -> RecordedStream:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                item = next(self._items)
            except Exception:  # its end (StopIteration) or a failure: recorded either way
                self._end()
                raise
            if self._reader.read(item, self._seen):
                return item

    def __enter__(self) -> RecordedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            self._end()


class RecordedAsyncStream(_Recorded):
    """An asyncio stream (``AsyncStream``): ``async for``, or ``async with``."""

    def __init__(self, inner: Any, reader: Reader, rec: Recorder, model: Any) -> None:
        super().__init__(inner, reader, rec, model)
        self._items = inner.__aiter__()

    def __aiter__(self) -> RecordedAsyncStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            try:
                item = await self._items.__anext__()
            except Exception:  # its end (StopAsyncIteration) or a failure
                await self._aend()
                raise
            if self._reader.read(item, self._seen):
                return item

    async def __aenter__(self) -> RecordedAsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            closing = close() if close is not None else None
            if inspect.isawaitable(closing):
                await closing
        finally:
            await self._aend()

    async def _aend(self) -> None:
        ending = self._ending()
        if ending is not None:
            await self._rec.arecord(*ending)
