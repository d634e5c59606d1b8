"""What the chaos run proves, read back from the store, the step log (outside the
store) and the stand-in provider's call log — never from the workers' own word."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

from fleet import Fleet
from tests.chaos.faults import FREEZE, KILL, PG_RESTART, Body, Fault
from tests.chaos.probe import UNREPORTED, StoreProbe
from tests.provider import provider_calls

# The retry-then-succeed step runs twice by design; every other step once.
DESIGNED_STARTS = {"fetch": 2}


@dataclass
class Report:
    seed: int
    runs: int
    faults: list[Fault]
    lost: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)
    applied_twice: list[str] = field(default_factory=list)
    effect_mismatch: list[str] = field(default_factory=list)
    fenced_writes: int = 0
    stale_finishes: int = 0  # bodies that finished after their lease was taken over
    stale_expected_fenced: int = 0  # …whose process lived on to try the commit
    stale_excused: Counter[str] = field(default_factory=Counter)  # …and why the others not
    takeovers: int = 0
    # Step bodies a freeze caught and a newer attempt took over before the thaw: each
    # zombie's write must be fenced (or never made, if its process died first).
    zombies: int = 0
    zombies_fenced: int = 0
    zombies_silent: int = 0  # never wrote: killed, or the store was restarting
    zombies_through: list[str] = field(default_factory=list)  # written, not fenced
    steps_executed: int = 0
    re_executed: int = 0
    provider_calls: int = 0
    zombie_calls: int = 0  # …of them by attempts frozen between lease check and call
    kill_to_restart: list[float] = field(default_factory=list)
    kills_without_step: int = 0
    seconds: float = 0.0
    # Store-level checks by name (tests/chaos/checks.py): each failure found, none: held.
    checks: dict[str, list[str]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the workload's own figures

    @property
    def failures(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} run(s) lost:\n" + "\n".join(self.lost[:5]))
        if self.differing:
            out.append(
                f"{len(self.differing)} run(s) differ from the fault-free run: {self.differing[:5]}"
            )
        if self.applied_twice:
            out.append(
                f"{len(self.applied_twice)} effect(s) applied twice: {self.applied_twice[:5]}"
            )
        if self.effect_mismatch:
            out.append(
                f"{len(self.effect_mismatch)} run(s) whose recorded effect is not the "
                f"provider's: {self.effect_mismatch[:5]}"
            )
        if self.zombies_through:
            out.append(
                f"{len(self.zombies_through)} write(s) of a frozen attempt after its step "
                f"was taken over got through the fence: {self.zombies_through[:5]}"
            )
        if self.fenced_writes < self.stale_expected_fenced:
            out.append(
                f"{self.stale_expected_fenced} late finish(es) after a takeover but only "
                f"{self.fenced_writes} fenced write(s): a zombie's write got through"
            )
        for name, found in self.checks.items():
            if found:
                out.append(f"check {name}: {len(found)} failure(s): {found[:3]}")
        return out

    @property
    def ok(self) -> bool:
        return not self.failures

    def figures(self) -> dict[str, Any]:
        kinds = Counter(f.kind for f in self.faults)
        deltas = self.kill_to_restart
        return {
            "seed": self.seed,
            "runs": self.runs,
            "faults": len(self.faults),
            "faults_by_kind": dict(sorted(kinds.items())),
            "runs_lost": len(self.lost),
            "outputs_differing": len(self.differing),
            "effects_applied_twice": len(self.applied_twice),
            "effects_not_matching_provider": len(self.effect_mismatch),
            "fenced_writes_rejected": self.fenced_writes,
            "late_finishes_after_takeover": self.stale_finishes,
            "late_finishes_that_had_to_be_fenced": self.stale_expected_fenced,
            "late_finishes_excused": dict(self.stale_excused),
            "takeovers": self.takeovers,
            "zombies_taken_over_while_frozen": self.zombies,
            "zombies_fenced": self.zombies_fenced,
            "zombies_that_never_wrote": self.zombies_silent,
            "zombie_writes_through": len(self.zombies_through),
            "steps_executed": self.steps_executed,
            "steps_re_executed": self.re_executed,
            "re_executed_per_fault": round(self.re_executed / max(1, len(self.faults)), 2),
            "provider_calls": self.provider_calls,
            "provider_calls_by_zombies_frozen_after_their_check": self.zombie_calls,
            "kill_to_restart_s": distribution(deltas),
            "kills_with_no_step_in_flight": self.kills_without_step,
            "checks_failed": {name: len(found) for name, found in self.checks.items()},
            **self.extra,
            "seconds": round(self.seconds, 1),
        }

    def render(self) -> str:
        f = self.figures()
        k = f["kill_to_restart_s"]
        what = (
            f"{self.extra['programs']} programs ({self.extra['runs']} runs)"
            if "programs" in self.extra
            else f"{self.runs} runs"
        )
        lines = [
            f"chaos seed {self.seed}: {what}, {f['faults']} faults "
            f"{f['faults_by_kind']} in {f['seconds']}s",
            f"  runs lost                        {f['runs_lost']}",
            f"  outputs differing from fault-free {f['outputs_differing']}",
            f"  effects applied twice            {f['effects_applied_twice']}"
            f"  ({f['provider_calls']} provider calls, {self.zombie_calls} of them by a "
            f"zombie frozen after its lease check)",
            f"  fenced writes rejected           {f['fenced_writes_rejected']}"
            f"  ({f['late_finishes_after_takeover']} late finishes after "
            f"{f['takeovers']} takeovers; {self.stale_expected_fenced} had to be)",
            f"  zombies fenced                   {self.zombies_fenced} of {self.zombies} "
            f"frozen mid-step and taken over ({self.zombies_silent} never wrote, "
            f"{len(self.zombies_through)} got through)",
            f"  steps re-executed                {f['steps_re_executed']} of "
            f"{f['steps_executed']} ({f['re_executed_per_fault']} per fault)",
            (
                f"  kill → step running again        {_spread(k)} interrupted steps"
                if k["n"]
                else "  kill → step running again        (no step was interrupted by a kill)"
            ),
        ]
        apart = (
            ("kill_to_restart_in_a_limit_s", "in a limit's line", "it waits for room by design"),
            (
                "kill_to_restart_after_a_replay_s",
                "replayed after it died",
                "it ran again when its dead letter was replayed",
            ),
        )
        for key, what, why in apart:
            d = self.extra.get(key)
            if d and d["n"]:
                lines.append(f"    …of a step {what}  {_spread(d)} (counted apart: {why})")
        if self.checks:
            held = ", ".join(f"{n} {len(v)}" for n, v in self.checks.items())
            lines.append(f"  store checks failed               {held}")
        if "programs" in self.extra:
            lines.append(f"  ends {self.extra['ends']}; driver {self.extra['driver']}")
            lines.append(f"  retention meanwhile              {self.extra.get('retention', {})}")
            died = self.extra.get("died_of_faults", 0)
            lines.append(f"  steps that died of faults        {died}")
        verdict = "PASS" if self.ok else "FAIL: " + "; ".join(self.failures)
        lines.append(f"  {verdict}")
        return "\n".join(lines)


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``, rounded; None if there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))], 2)


def _events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def analyse(
    client: Fleet,
    seed: int,
    jobs: dict[str, int],
    reference: dict[int, Any],
    faults: list[Fault],
    log: Path,
    provider: Path,
    stopped_at: float,
) -> Report:
    report = Report(seed, len(jobs), faults)
    db = client.runtime.db
    with db.engine.connect() as conn:
        runs = {r.id: r for r in conn.execute(text("SELECT id, status, result FROM fleet_runs"))}
        steps = {
            (s.run_id, s.step_id): s
            for s in conn.execute(text("SELECT run_id, step_id, name, epoch FROM fleet_steps"))
        }
    outputs: dict[str, Any] = {}
    for rid, job in jobs.items():
        row = runs.get(rid)
        if row is None or row.status != "succeeded":
            report.lost.append(f"{rid} ({row.status if row else 'missing'})")
            continue
        outputs[rid] = client.runtime.payloads.load(row.result)
        if outputs[rid] != reference[job]:
            report.differing.append(rid)

    events = _events(log)
    _effects(report, outputs, steps, provider, events, faults)
    common_figures(report, client, faults, events, steps, stopped_at, DESIGNED_STARTS)
    return report


def common_figures(
    report: Report,
    client: Fleet,
    faults: list[Fault],
    events: list[dict[str, Any]],
    steps: dict[Any, Any],
    stopped_at: float,
    designed: dict[str, int] | None = None,
    known: Mapping[Body, str] | None = None,
    limited: frozenset[tuple[str, str]] = frozenset(),
) -> None:
    """What any workload's report says of its faults: the store's fenced writes and
    takeovers, the frozen zombies' outcomes, and from the step log's ``events``
    re-executions, late finishes and the time from a kill to the interrupted step
    running again. ``designed``: each step name's
    starts by design (re-executions are the starts past them); None: a re-execution is
    a start after an attempt of the same step that never ended. ``known``: attempts'
    outcomes as captured before retention deleted them. ``limited``: the (run, step)
    of steps inside a concurrency limit, whose recoveries are counted apart."""
    # With what retention kept of the incidents of the runs it deleted.
    incidents = client.runtime.queries.figures().incidents
    report.fenced_writes = incidents.get("fenced_write", 0)
    report.takeovers = incidents.get("takeover", 0)
    _zombies(report, client, faults, known)
    if designed is None:
        _interrupted_starts(report, events)
    else:
        _executions(report, events, steps, designed)
    _stale(report, events, steps, faults, stopped_at)
    _recoveries(report, events, faults, limited)


def _zombies(
    report: Report, client: Fleet, faults: list[Fault], known: Mapping[Body, str] | None
) -> None:
    """How each attempt a freeze caught, and saw taken over before its thaw, ended in
    the store: fenced, or never written (running or lost); anything else means its
    write was applied after the takeover."""
    bodies: list[Body] = [b for f in faults if f.kind == FREEZE for b in f.taken_over]
    report.zombies = len(bodies)
    outcomes = StoreProbe(client).outcomes(bodies)
    if outcomes is None:
        raise RuntimeError("the store did not answer for the frozen attempts' outcomes")
    for body, outcome in outcomes.items():  # pruned since: as captured before the prune
        if outcome == "missing" and known and body in known:
            outcomes[body] = known[body]
    for (run_id, step_id, epoch), outcome in sorted(outcomes.items()):
        if outcome == "fenced":
            report.zombies_fenced += 1
        elif outcome in UNREPORTED:
            report.zombies_silent += 1
        else:
            report.zombies_through.append(f"{run_id} {step_id} epoch {epoch}: {outcome}")


def called_after_freeze(events: list[dict[str, Any]], faults: list[Fault]) -> Counter[str]:
    """Per idempotency key, the provider calls of attempts a freeze caught after they
    had confirmed their lease: woken after the takeover, such a zombie calls with the
    key its successor uses too, which the key exists to absorb (effects are at least
    once, made effectively once by the key). An attempt frozen before its check is
    stopped by it (LeaseLost) and is not counted here."""
    frozen_at = {tuple(b): f.at for f in faults if f.kind == FREEZE for b in f.caught}
    out: Counter[str] = Counter()
    for e in events:
        at = frozen_at.get((e["run"], e["step"], e["epoch"]))
        if e["event"] == "call" and at is not None and e["checked_at"] < at:
            out[f"{e['run']}:{e['step']}"] += 1
    return out


def _effects(
    report: Report,
    outputs: dict[str, Any],
    steps: dict[Any, Any],
    provider: Path,
    events: list[dict[str, Any]],
    faults: list[Fault],
) -> None:
    """Each effect called once per key, besides the calls of zombies frozen between
    their lease check and their call; and the run's recorded effect is the one the
    provider applied."""
    calls = provider_calls(str(provider))
    report.provider_calls = len(calls)
    per_key = Counter(c["key"] for c in calls)
    excused = called_after_freeze(events, faults)
    report.zombie_calls = sum(excused.values())
    report.applied_twice = sorted(k for k, n in per_key.items() if n - excused[k] > 1)
    applied = {c["key"]: c["body"] for c in calls if c["applied"]}
    for (rid, step_id), s in steps.items():
        if s.name != "charge" or rid not in outputs:
            continue
        if applied.get(f"{rid}:{step_id}") != outputs[rid]["charged"]:
            report.effect_mismatch.append(rid)


def _executions(
    report: Report, events: list[dict[str, Any]], steps: dict[Any, Any], designed: dict[str, int]
) -> None:
    starts = Counter((e["run"], e["step"]) for e in events if e["event"] == "start")
    report.steps_executed = len(starts)
    for key, n in starts.items():
        name = steps[key].name if key in steps else ""
        report.re_executed += max(0, n - designed.get(name, 1))


def _interrupted_starts(report: Report, events: list[dict[str, Any]]) -> None:
    """Steps executed, and starts that follow an attempt of the same step that started
    and never ended (killed, frozen and taken over, or cut off from the store)."""
    by_step: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["event"] in ("start", "end"):
            by_step[(e["run"], e["step"])].append(e)
    report.steps_executed = len(by_step)
    for evs in by_step.values():
        ended = {e["epoch"]: e["t"] for e in evs if e["event"] == "end"}
        starts = sorted((e["t"], e["epoch"]) for e in evs if e["event"] == "start")
        for (_, before), (t, _) in zip(starts, starts[1:], strict=False):
            if ended.get(before, t) >= t:  # not ended before the next start began
                report.re_executed += 1


def _stale(
    report: Report,
    events: list[dict[str, Any]],
    steps: dict[Any, Any],
    faults: list[Fault],
    stopped_at: float,
) -> None:
    """Bodies that finished after a newer attempt of their step had started (a takeover):
    their write must have been refused, unless their process died first, the store
    was restarting, or the attempt's own lease check stopped it (LeaseLost: it writes
    nothing)."""
    # The workers are all killed at ``stopped_at``, once every run has finished: a body
    # that a late thaw let finish just before may not have reached its commit.
    kills = [(f.pid, f.at) for f in faults if f.kind == KILL]
    kills += [(pid, stopped_at) for pid in {e["pid"] for e in events}]
    restarts = [(f.at - 1.0, f.until + 3.0) for f in faults if f.kind == PG_RESTART]
    newer: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for e in events:
        if e["event"] == "start":
            newer[(e["run"], e["step"])].append((e["epoch"], e["t"]))
    for e in events:
        if e["event"] != "end" or (e["run"], e["step"]) not in steps:
            continue
        taken_over = any(
            epoch > e["epoch"] and t < e["t"] for epoch, t in newer[(e["run"], e["step"])]
        )
        if not taken_over:
            continue
        report.stale_finishes += 1
        if e.get("error") == "LeaseLost":  # its own lease check stopped it: no write made
            report.stale_excused["stopped by its lease check"] += 1
            continue
        died = any(pid == e["pid"] and e["t"] <= at <= e["t"] + 3.0 for pid, at in kills)
        store_down = any(lo <= e["t"] <= hi for lo, hi in restarts)
        if died:
            report.stale_excused["worker killed"] += 1
        elif store_down:
            report.stale_excused["store restarting"] += 1
        else:
            report.stale_expected_fenced += 1


def _spread(d: Mapping[str, Any]) -> str:
    """A ``distribution`` as the report prints it."""
    return f"median {d['median']}s, p90 {d['p90']}s, p99 {d['p99']}s, max {d['max']}s over {d['n']}"


def distribution(deltas: list[float]) -> dict[str, Any]:
    """n, median, p90, p99 (nearest rank) and max of ``deltas``, in seconds."""
    return {
        "n": len(deltas),
        "median": round(statistics.median(deltas), 2) if deltas else None,
        "p90": _quantile(deltas, 0.90),
        "p99": _quantile(deltas, 0.99),
        "max": round(max(deltas), 2) if deltas else None,
    }


def _recoveries(
    report: Report,
    events: list[dict[str, Any]],
    faults: list[Fault],
    limited: frozenset[tuple[str, str]] = frozenset(),
) -> None:
    """For each kill: the steps its worker had started and not ended, and how long until
    each ran again under a newer epoch. Counted apart: a step that names a concurrency
    limit (in ``limited``, as (run, step)), which runs again only once the limit has
    room (its wait in the limit's line is by design, not the crash's), and a step that
    died meanwhile and ran again only when its dead letter was replayed."""
    by_step: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_step[(e["run"], e["step"])].append(e)
    slow: list[tuple[float, str, str, float]] = []
    in_line: list[float] = []
    replayed: list[float] = []
    for f in faults:
        if f.kind != KILL:
            continue
        interrupted = 0
        for evs in by_step.values():
            mine = [e for e in evs if e["pid"] == f.pid and e["t"] <= f.at]
            started = [e for e in mine if e["event"] == "start"]
            if not started:
                continue
            last = started[-1]
            if any(e["event"] == "end" and e["epoch"] == last["epoch"] for e in mine):
                continue
            again = [
                e
                for e in evs
                if e["event"] == "start" and e["epoch"] > last["epoch"] and e["t"] > f.at
            ]
            if not again:
                continue
            interrupted += 1
            first = min(again, key=lambda e: e["t"])
            took = first["t"] - f.at
            if first["attempt"] <= last["attempt"]:
                # A fresh attempt budget: the step died meanwhile (its attempts spent by
                # crashes) and ran again only when its dead letter was replayed.
                replayed.append(took)
            elif (last["run"], last["step"]) in limited:
                in_line.append(took)
            else:
                report.kill_to_restart.append(took)
                slow.append((round(took, 2), last["run"], last["step"], f.at))
        if not interrupted:
            report.kills_without_step += 1
    # The slowest recoveries, to look up in the logs: seconds, run, step, kill time.
    report.extra["slowest recoveries"] = sorted(slow, reverse=True)[:8]
    if limited:
        report.extra["kill_to_restart_in_a_limit_s"] = distribution(in_line)
    report.extra["kill_to_restart_after_a_replay_s"] = distribution(replayed)
