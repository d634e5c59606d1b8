"""Prometheus figures for the fleet, served by ``fleet metrics --port P``.

Everything that must be fleet-wide (fenced writes, duplicate deliveries, takeovers,
steps by outcome) is read from the store at scrape time, so one exporter gives the
right numbers however many workers run; queue depth is read from the broker.

The counters (``_total``, and the duration histogram) never go back: the store's
figures add what retention kept of the rows it deleted (fleet/store/totals.py), and a
label set once reported stays.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from fleet.app import Fleet
from fleet.states import Incident, RunStatus
from fleet.store.totals import DURATION_BUCKETS
from fleet.worker import dispatch
from fleet.worker.gate import uses

log = logging.getLogger("fleet.metrics")

BUCKETS = DURATION_BUCKETS  # the bounds retention keeps pruned attempts' durations in


class FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Any]:
        f = self.fleet.runtime.queries.figures(BUCKETS)
        runs = GaugeMetricFamily("fleet_runs", "Runs by status", labels=["status"])
        for status in RunStatus:
            runs.add_metric([status.value], f.runs.get(status.value, 0))
        yield runs

        attempts = f.attempts
        started = sum(attempts.values())
        for name, doc, value in (
            ("fleet_steps_started", "Step attempts started (leases taken)", started),
            ("fleet_steps_succeeded", "Step attempts that committed", attempts.get("done", 0)),
            ("fleet_steps_retried", "Step attempts that failed", attempts.get("failed", 0)),
            ("fleet_steps_lost", "Step attempts lost with their worker", attempts.get("lost", 0)),
            ("fleet_steps_dead_lettered", "Steps dead-lettered", f.dead_letters),
        ):
            yield CounterMetricFamily(name, doc, value=value)

        incidents = f.incidents
        for name, kind in (
            ("fleet_fenced_writes_rejected", Incident.FENCED_WRITE),
            ("fleet_duplicate_deliveries_dropped", Incident.DUPLICATE_DELIVERY),
            ("fleet_leases_taken_over", Incident.TAKEOVER),
            ("fleet_version_mismatches", Incident.VERSION_MISMATCH),
            ("fleet_effects_in_doubt", Incident.EFFECT_IN_DOUBT),
            ("fleet_malformed_messages", Incident.MALFORMED_MESSAGE),
        ):
            yield CounterMetricFamily(
                name, f"Incidents: {kind.value}", value=incidents.get(kind, 0)
            )

        yield GaugeMetricFamily(
            "fleet_waits_open", "wait_for and sleep steps pending", value=f.waits_open
        )
        yield GaugeMetricFamily(
            "fleet_dead_letters_outstanding",
            "Dead letters not replayed",
            value=f.dead_letters_outstanding,
        )
        yield GaugeMetricFamily(
            "fleet_dead_messages",
            "Broker messages workers refused and set aside, not yet purged",
            value=self.fleet.runtime.queries.dead_message_count(),
        )

        cumulative = [(str(b), n) for b, n in zip(BUCKETS, f.duration_buckets, strict=True)]
        yield HistogramMetricFamily(
            "fleet_step_duration_seconds",
            "Duration of finished step attempts",
            buckets=[*cumulative, ("+Inf", f.duration_count)],
            sum_value=f.duration_sum,
        )

        tokens = CounterMetricFamily(
            "fleet_tokens",
            "Model tokens recorded by steps",
            labels=["workflow", "model", "direction"],
        )
        cost = CounterMetricFamily(
            "fleet_cost", "Model cost recorded by steps", labels=["workflow", "model"]
        )
        for workflow, model, tin, tout, spent in f.spend:
            tokens.add_metric([workflow, model, "input"], tin)
            tokens.add_metric([workflow, model, "output"], tout)
            cost.add_metric([workflow, model], spent)
        yield tokens
        yield cost

        yield from self._limits()

        depth = GaugeMetricFamily(
            "fleet_queue_depth", "Messages waiting in the broker", labels=["queue"]
        )
        for queue, size in self._queue_depths(f.live_queues).items():
            depth.add_metric([queue], size)
        yield depth

    def _limits(self) -> Iterator[Any]:
        """Each limit's use now (``fleet limits``), by limit key."""
        try:
            found = uses(self.fleet.runtime)
        except Exception as exc:  # the limiter's Redis down: the store's figures still count
            log.warning("limits unavailable: %s", exc)
            return
        for name, doc, field in (
            ("fleet_limit_running", "Steps holding a limit's concurrency slot", "running"),
            ("fleet_limit_requests", "Steps started under a limit in the last minute", "requests"),
            ("fleet_limit_tokens", "Tokens counted in a limit over the last minute", "tokens"),
            ("fleet_limit_waiting", "Steps waiting for room in a limit", "waiting"),
            ("fleet_limit_paused_seconds", "How long a limit stays paused (a 429)", "paused_for"),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["limit"])
            for use in found:
                gauge.add_metric([use.key], getattr(use, field))
            yield gauge

    def _queue_depths(self, live: list[str]) -> dict[str, int]:
        base = self.fleet.settings.queue
        names = {base, *live, *(wf.queue(base) for wf in self.fleet.registry.workflows.values())}
        try:
            return dispatch.queue_depths(self.fleet.celery, sorted(names))
        except Exception as exc:  # broker down: the store's figures still count
            log.warning("queue depth unavailable: %s", exc)
            return {}
