"""How a Postgres connection waits for its socket: as psycopg does (the thread blocks),
or, for a greenlet that brings its own way of waiting, that greenlet's way.

The worker runs attempts of ``async def`` steps as greenlets on its event loop's thread
(fleet/worker/on_loop.py). Such a greenlet sets ``park_on_socket`` on itself: while one
of its round trips to the store is out, it parks until the loop sees the socket ready,
and the loop runs the others meanwhile (their coroutines, their own round trips), so
one thread keeps many transactions in flight without blocking a coroutine. A socket
ready at once (a write, mostly) is not parked on. Every other caller (a slot's thread,
a plain greenlet, a coroutine on the loop itself) waits as psycopg always does.

A connection is used by one caller at a time (the pool hands it out), so nothing else
touches it while its greenlet is parked; psycopg's own lock on it is held meanwhile,
as it is across any wait.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

import greenlet
import psycopg
from psycopg.waiting import Ready, Wait
from sqlalchemy import event
from sqlalchemy.engine import Engine

# What a socket is ready for, as ``park_on_socket`` answers (psycopg's ``Ready``).
READABLE = int(Ready.R)
WRITABLE = int(Ready.W)

# A greenlet's ``park_on_socket(fileno, read, write)``: park until the socket is ready
# to be read (``read``) or written (``write``); returns READABLE and/or WRITABLE.
Park = Callable[[int, bool, bool], int]


class Connection(psycopg.Connection[Any]):
    """psycopg's connection, its waits the calling greenlet's if it has its own."""

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        park: Park | None = getattr(greenlet.getcurrent(), "park_on_socket", None)
        if park is None or timeout is not None:  # a timed wait (notifies): psycopg's
            return super().wait(gen, interval, timeout)
        return _drive(gen, self.pgconn.socket, park)


def _drive(gen: Any, fileno: int, park: Park) -> Any:
    """psycopg's generator for one operation driven to its end (it yields what it waits
    for, a ``Wait``, and is sent what is ready), parking only when the socket is not
    ready at once; what the generator returned."""
    try:
        state = next(gen)
        while True:
            reading, writing = bool(state & Wait.R), bool(state & Wait.W)
            ready = _ready_now(fileno, reading, writing) or park(fileno, reading, writing)
            state = gen.send(Ready(ready))
    except StopIteration as ex:
        return ex.value


def _ready_now(fileno: int, reading: bool, writing: bool) -> int:
    """What the socket is ready for at once, of what is asked (0: nothing yet)."""
    poller = select.poll()
    poller.register(fileno, (select.POLLIN if reading else 0) | (select.POLLOUT if writing else 0))
    events = poller.poll(0)
    if not events:
        return 0
    revents = events[0][1]
    broken = revents & (select.POLLERR | select.POLLHUP)  # psycopg reads the error
    ready = READABLE if reading and (revents & select.POLLIN or broken) else 0
    if writing and (revents & select.POLLOUT or broken):
        ready |= WRITABLE
    return ready


def applies(engine: Engine) -> bool:
    """Whether ``engine``'s connections are psycopg's, and so can wait this way."""
    return engine.dialect.driver == "psycopg"


def cooperative(engine: Engine) -> None:
    """Have ``engine`` open its Postgres connections as ``Connection`` (if ``applies``)."""
    if not applies(engine):
        return

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Connection:
        return Connection.connect(*cargs, **cparams)
