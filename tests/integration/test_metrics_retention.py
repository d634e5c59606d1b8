"""The metrics' counters across retention (issue 48, item 4): every ``_total`` series, and
the step duration histogram's, reads the same after a prune as before it, none lower and
none gone, however many prunes. Retention keeps what it deletes as totals
(fleet/store/totals.py) and the figures add them. Both stores."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleet import Fleet
from fleet.ops.metrics import FleetCollector
from fleet.states import Incident
from tests.harness import Backend, InlineBroker
from tests.integration.test_retention import every_kind, run_ids

Sample = tuple[str, tuple[tuple[str, str], ...]]
# What Prometheus reads as a counter: a reset where any of these goes down.
COUNTED = ("_total", "_bucket", "_count", "_sum")


def counters(client: Fleet) -> dict[Sample, float]:
    """One scrape of the exporter's collector: every counter sample, by name and labels."""
    registry = CollectorRegistry()
    registry.register(FleetCollector(client))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.endswith(COUNTED)
    }


def same_or_higher(before: dict[Sample, float], after: dict[Sample, float]) -> dict[str, Any]:
    """The series that vanished or went down between two scrapes."""
    return {
        "vanished": sorted(set(before) - set(after)),
        "lower": {k: (v, after[k]) for k, v in before.items() if k in after and after[k] < v},
    }


def test_no_counter_goes_back_or_vanishes_when_retention_deletes_its_rows(
    backend: Backend, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = every_kind(client, inline, backend, monkeypatch)
    client.runtime.ledger.incident(Incident.FENCED_WRITE, made["gone:effect"], "notify#1")
    before = counters(client)
    tokens = (
        "fleet_tokens_total",
        (("direction", "input"), ("model", "stand-in"), ("workflow", "chain")),
    )
    assert before[tokens] > 0 and before[("fleet_fenced_writes_rejected_total", ())] == 1

    pruned = client.prune(0, batch=2)
    # Rows of every kind the counters count went: the test would pass vacuously otherwise.
    assert pruned.runs == 7 and pruned.attempts and pruned.incidents and pruned.dead_letters
    after = counters(client)
    assert same_or_higher(before, after) == {"vanished": [], "lower": {}}
    assert after == pytest.approx(before), "nothing ran between the scrapes"

    # A second round adds to the kept totals (the same label sets again).
    again = client.enqueue("chain", 3).id
    inline.drain()  # the queued run of every_kind runs too
    before = counters(client)
    assert before[tokens] > after[tokens], "the new run's spend is counted"
    assert client.prune(0).runs == 2 and again not in run_ids(client)
    after = counters(client)
    assert same_or_higher(before, after) == {"vanished": [], "lower": {}}
    assert after == pytest.approx(before)
    assert client.prune(0, dry_run=True).runs == 0 and counters(client) == after
