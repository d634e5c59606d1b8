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


def test_a_watched_lease_revoked_in_the_store_is_found_between_renewals() -> None:
    """An attempt that wants to hear at once (an async step's task) learns within about
    REVOKE_CHECK that the store no longer holds its lease; one that does not is left to
    its next renewal."""
    asked: list[set[str]] = []

    def leases_held(keys: list[tuple[str, str, int]]) -> set[Any]:
        asked.append({step_id for _, step_id, _ in keys})
        return set()  # revoked: the run was cancelled

    rt: Any = SimpleNamespace(
        ledger=FakeLedger(),
        queries=SimpleNamespace(leases_held=leases_held),
        settings=SimpleNamespace(lease_seconds=600.0),
    )
    watched = Heartbeat(rt, Lease("run", "watched", 1, 1, "work", "{}", False), _BEATER)
    plain = Heartbeat(rt, Lease("run", "plain", 1, 1, "work", "{}", False), _BEATER)
    told = threading.Event()
    with watched, plain:
        watched.when_lost(told.set)
        assert told.wait(5), "the revoked lease was found"
        assert watched.lost.is_set() and not plain.lost.is_set()
    assert asked and all(steps == {"watched"} for steps in asked)
    assert rt.ledger.renewals == [], "found by the check, not by a renewal"


def test_schedules_hold_while_thousands_of_attempts_come_and_go() -> None:
    """Renewals come up in order of when they are due however many attempts have come
    and gone: none that left is renewed, and what the beater keeps of them is bounded."""
    ledger = FakeLedger()
    fast = _heartbeat(ledger, "fast", 0.06)
    with fast:
        for i in range(3000):
            with _heartbeat(ledger, f"gone-{i}", 600.0):
                pass
        kept = [_heartbeat(ledger, f"kept-{i}", 600.0) for i in range(50)]
        for hb in kept:
            hb.__enter__()
        poll(lambda: ledger.count("fast") >= 3, 5, "three renewals of the short lease")
        assert len(_BEATER._queue) <= 2 * len(_BEATER.held()) + 64
        for hb in kept:
            hb.__exit__(None, None, None)
    assert set(ledger.renewals) == {"fast"}
