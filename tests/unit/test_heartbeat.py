"""The process's one heartbeat thread renews every held lease when due, stops at a
lost one, and never renews for an attempt that has left. A fake ledger; no services."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from fleet.store.ledger import Lease
from fleet.worker import process
from fleet.worker.heartbeat import Heartbeat
from tests.harness import poll

_BEATER = process.current().beater


class FakeLedger:
    def __init__(self, answer: bool = True) -> None:
        self.answer = answer
        self.renewals: list[str] = []
        self.lock = threading.Lock()

    def heartbeat(self, run_id: str, step_id: str, epoch: int, lease_seconds: float) -> bool:
        with self.lock:
            self.renewals.append(step_id)
        return self.answer

    def count(self, step_id: str) -> int:
        with self.lock:
            return self.renewals.count(step_id)


def _heartbeat(ledger: FakeLedger, step_id: str, lease_seconds: float) -> Heartbeat:
    rt: Any = SimpleNamespace(ledger=ledger, settings=SimpleNamespace(lease_seconds=lease_seconds))
    return Heartbeat(rt, Lease("run", step_id, 1, 1, "work", "{}", False), _BEATER)


def test_one_thread_renews_each_held_lease_when_due() -> None:
    ledger = FakeLedger()
    fast, slow = _heartbeat(ledger, "fast", 0.06), _heartbeat(ledger, "slow", 0.6)
    with fast, slow:
        poll(lambda: ledger.count("fast") >= 3, 5, "three renewals of the short lease")
        assert ledger.count("slow") <= 1, "each lease on its own schedule"
        poll(lambda: ledger.count("slow") >= 1, 5, "the longer lease renewed too")
        assert {t.name for t in threading.enumerate()} >= {"fleet-heartbeat"}
        assert sum(t.name == "fleet-heartbeat" for t in threading.enumerate()) == 1
    assert fast not in _BEATER.held() and slow not in _BEATER.held()
    before = ledger.count("fast")
    fast.renew_if_held()  # what the thread would do if it had picked the lease just now
    assert ledger.count("fast") == before, "no renewal once the attempt has left"


def test_a_lost_lease_is_no_longer_renewed() -> None:
    ledger = FakeLedger(answer=False)
    hb = _heartbeat(ledger, "taken-over", 0.06)
    with hb:
        poll(lambda: hb.lost.is_set(), 5, "the renewal to find the lease lost")
        assert hb not in _BEATER.held()
        assert not hb.beat(), "an explicit heartbeat raises LeaseLost from here on"
    assert ledger.count("taken-over") == 1
