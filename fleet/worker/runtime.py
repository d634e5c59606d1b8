"""What the engine's parts share in one process: settings, store, registry, broker."""

from __future__ import annotations

import functools
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fleet.config import Settings
from fleet.registry import Registry
from fleet.store.engine import Database, Transaction
from fleet.store.ledger import Ledger
from fleet.store.payloads import Payloads
from fleet.store.queries import Queries
from fleet.worker.dispatch import Dispatcher


# eq=False: a runtime is one Fleet's, compared and hashed by identity (the process
# holds the registered ones in a weak mapping).
@dataclass(eq=False)
class Runtime:
    settings: Settings
    db: Database
    ledger: Ledger
    queries: Queries
    registry: Registry
    dispatcher: Dispatcher
    dead_letter_hooks: list[Callable[[Any], Any]] = field(default_factory=list)
    payloads: Payloads = field(init=False)

    def __post_init__(self) -> None:
        self.payloads = Payloads(self.settings, self.ledger, self.queries)

    def within(self, tx: Transaction) -> Runtime:
        """This runtime with its store bound to ``tx``: every ledger write, read and
        stored payload made through it runs in that transaction. Cheap: the same
        database (engine, history cache), registry and dispatcher."""
        return replace(self, ledger=self.ledger.within(tx), queries=self.queries.within(tx))

    @property
    def worker_name(self) -> str:
        # Per process: Celery's prefork children each hold their own leases.
        return _worker_name(self.settings.worker_name, os.getpid())


@functools.lru_cache(maxsize=16)
def _worker_name(configured: str | None, pid: int) -> str:
    """Named once per process (a step asks two or three times: its lease, its log
    line; the host's name is a system call)."""
    return f"{configured or socket.gethostname()}:{pid}"


def under_gevent() -> bool:
    """This process runs a gevent pool: threads, locks and sockets are greenlets' ones."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("threading"))
