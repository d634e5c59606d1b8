"""The chaos run's program workload: generated programs (tests/chaos/programs.py) on the
workers under fire, the driver (driver.py) acting on their runs, and once they have all
ended, every tree compared with the model (model.py) and checked from the store
(checks.py). ``python -m tests.chaos --programs N`` runs it; harness.py owns the fleet
and the faults, this module what runs on it and what is checked.

Retention runs throughout: every few seconds the harness prunes (``Fleet.prune`` in a
pruner process with the workers' engine, tests/chaos/pruner.py) what finished before
its last look (and the sweeper's own retention prunes what finished a
minute ago), so a tree is read whole (``checks.capture`` of each of
its runs, with its transcript) as soon as it has ended, before it can be pruned; a
run pruned while its tree was live (a retention bug) is then missing from it.

A step the faults cost attempts may die where the model's fault-free run does not: a
dead step one of whose attempts was lost, fenced or failed with an error no program
raises (a cut connection, say) "died of faults", and the model is told so (``died``:
its end and error then allow any attempt count and error; an effect that died may have
been applied once or not at all). A step that died of its own mode is compared exactly.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sqlalchemy import text

from fleet import Fleet
from tests.chaos import program_flows
from tests.chaos import programs as P
from tests.chaos.checks import (
    LIVE,
    capture,
    check_overlap,
    check_replays,
    check_settled,
    read_lines,
)
from tests.chaos.console_hands import Conflict, ConsoleHands, Unreachable
from tests.chaos.driver import Driver, tree_ids
from tests.chaos.faults import FLUSHALL, FREEZE, KILL, REDIS_RESTART, Fault
from tests.chaos.model import Observed, applications, differences, expected
from tests.chaos.report import Report, called_after_freeze, common_figures
from tests.provider import provider_calls

APP = "tests.chaos.program_flows"
# After a Redis flush or restart the limiter restores held slots from the store's
# leases at the next sweep; a body let in before that restore is the documented gap
# (README, "limits"): excused for this long after the fault ends.
RESTORE_GAP = 3.0
RERUN_EVERY = 2  # every other program's root id is enqueued again once pruned
RERUN_BASE = 1_000_000  # a rerun's program is this index past the first one's
SWEEPER_RETENTION = 60  # seconds: what the sweeper's own retention keeps
LOOK_EVERY = 1.0  # seconds between two looks for ended trees (and room in the window)


def root_id(seed: int, index: int) -> str:
    return f"cp-{seed}-{index}"


def _program_error(error: str | None, step_id: str) -> bool:
    """Whether an attempt's error is one a program's own fail modes raise for the step."""
    return bool(error) and any(text in error for text in P.fail_texts(step_id).values())


def died_of_faults(captures: Iterable[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """(run id, step id) of the dead task steps that a fault cost an attempt: one of
    their attempts was lost, fenced, left running, or failed with an error that is not
    their program's."""
    out: set[tuple[str, str]] = set()
    for cap in captures:
        for step in cap["steps"]:
            if step["status"] != "dead" or not step["tries"]:
                continue
            for t in step["tries"]:
                if t["outcome"] in ("lost", "fenced", "running") or (
                    t["outcome"] == "failed" and not _program_error(t["error"], step["id"])
                ):
                    out.add((cap["run"], step["id"]))
                    break
    return out


def replayable(caps: list[dict[str, Any]], root: str) -> tuple[str, str] | None:
    """The (run, step) an operator replays once the faults have killed a run: the one
    step of the tree that died of faults, in the root, whose death failed the root (its
    error names it), with no attached child cancelled by that end. Replayed, the root
    resumes from that step and must end as the fault-free model says. None if the tree
    is not so: other deaths would have turned the program onto another path, and a
    cancelled child stays cancelled."""
    died = died_of_faults(caps)
    if len(died) != 1:
        return None
    ((run_id, step_id),) = died
    ends = {c["run"]: c for c in caps}
    top = ends.get(root)
    if run_id != root or top is None or top["status"] != "failed":
        return None
    first = str(top["error"] or "").partition("\n")[0]
    if f"step {step_id} failed" not in first:
        return None
    if any(str(c["error"] or "").startswith("cancelled: parent run") for c in caps):
        return None
    return run_id, step_id


def letter_of(client: Fleet, run_id: str, step_id: str) -> int | None:
    """The id of the step's dead letter not replayed yet, if any."""
    letters = client.dead_letters(run_id=run_id)  # not replayed ones, oldest first
    return next((d.id for d in letters if d.step_id == step_id), None)


def capture_tree(client: Fleet, root: str) -> list[dict[str, Any]] | None:
    """Every run of the tree of ``root`` captured with its transcript (``raw``,
    ``window``); None while some run of it is live (or the tree is not in the store)."""
    caps = []
    for rid in tree_ids(client, root):
        cap = capture(client, rid)
        if cap is None:
            continue  # pruned since the list was read: the next look says more
        if cap["status"] in LIVE:
            return None
        info = client.transcript(rid)
        cap["raw"], cap["window"] = info.raw(), info.window()
        caps.append(cap)
    return caps or None


def history(caps: Iterable[Mapping[str, Any]], width: int = 4000) -> str:
    """The captured runs of a tree as a failure prints them: each run's end, then each
    step's status and its attempts (epoch:outcome@worker)."""
    lines = []
    for cap in caps:
        end = str(cap["error"] or json.dumps(cap["result"])).partition("\n")[0][:200]
        lines.append(f"    run {cap['run']} {cap['status']}: {end}")
        for step in cap["steps"]:
            tries = " ".join(f"{t['epoch']}:{t['outcome']}@{t['worker']}" for t in step["tries"])
            lines.append(f"      {step['id']} {step['kind']} {step['status']} [{tries}]")
    text = "\n".join(lines)
    return text if len(text) <= width else text[:width] + "\n      ..."


def _as_stored(client: Fleet, root: str) -> str:
    """A tree that has not ended, as the store has it: each run's row (status, wake-ups
    asked and answered, re-send time and count), each step's, each fan-out's count."""
    lines = []
    with client.runtime.db.engine.connect() as conn:
        for rid in tree_ids(client, root):
            run = conn.execute(
                text(
                    "SELECT status, wake_seq, advanced_seq, redispatch_at, dispatches, "
                    "updated_at FROM fleet_runs WHERE id = :r"
                ),
                {"r": rid},
            ).first()
            lines.append(f"    run {rid}: {tuple(run) if run else None}")
            for row in conn.execute(
                text(
                    "SELECT step_id, kind, status, attempts, epoch, fanout, redispatch_at, "
                    "dispatches, finished_at FROM fleet_steps WHERE run_id = :r ORDER BY seq"
                ),
                {"r": rid},
            ):
                lines.append(f"      {tuple(row)}")
            for row in conn.execute(
                text("SELECT fanout, size, settled FROM fleet_fanouts WHERE run_id = :r"),
                {"r": rid},
            ):
                lines.append(f"      fan-out {tuple(row)}")
    return "\n".join(lines)


def observed(cap: Mapping[str, Any]) -> Observed:
    """A captured run as the model's comparison reads it."""
    return Observed(cap["status"], cap["result"], cap["error"], cap["raw"], cap["window"])


@dataclass
class Entry:
    """One program enqueued (or to be) under a root id: the root's first program, or a
    rerun, enqueued under the same id once retention has deleted the first one's tree."""

    root: str
    prog: dict[str, Any]
    rerun: bool = False
    enqueued: bool = False
    captured: list[dict[str, Any]] | None = None
    captured_at: float = 0.0
    wants_rerun: bool = False  # a rerun follows once the tree is captured and pruned
    resolved: bool = False  # its rerun enqueued, or its tree kept by retention
    # The tree as it first ended, when the step the faults killed was then replayed
    # through the console (``replayable``); ``captured`` is its end after the replay.
    before_replay: list[dict[str, Any]] | None = None


def rerun_program(seed: int, index: int) -> dict[str, Any]:
    """The program enqueued again under the root id of program ``index`` once that was
    pruned: another program (of index ``RERUN_BASE + index``), every op id prefixed
    ``r`` so its steps, child runs and effect keys are its own."""
    prog = copy.deepcopy(P.generate(seed, RERUN_BASE + index))
    for op in P.walk(prog):
        op["id"] = "r" + op["id"]
    return prog


def _mine(applied: Mapping[str, int], rerun: bool) -> dict[str, int]:
    """The applications of the first program's effects (``rerun`` False) or its rerun's,
    told apart by the rerun's ``r`` op ids (keys ``run:step``)."""
    return {k: n for k, n in applied.items() if k.rpartition(":")[2].startswith("r") == rerun}


@dataclass
class ProgramWorkload:
    """``count`` programs of ``seed``, each a root run ``cp-SEED-I`` and its tree; every
    ``RERUN_EVERY``-th root id is enqueued again with another program once retention
    has deleted the first (a live run's cache keyed by run id must tell them apart)."""

    seed: int
    count: int
    indices: list[int] | None = None  # only these programs of the seed (``--index``)
    verbose: bool = False  # say each program, its model and its tree's history
    say: Callable[[str], None] = print
    entries: list[Entry] = field(default_factory=list)
    driver: Driver | None = None
    window: int = 0  # programs live at once, a new one enqueued as one ends (0: all)
    prune_every: float = 3.0  # seconds between two prunes (0: never, and no reruns)
    # Deletes the runs finished that many seconds ago or earlier; how many. The harness
    # sets it to its pruner process's, which runs the workers' engine (a planted bug's).
    prune: Callable[[int], int] = field(default=lambda seconds: 0)
    # The console's forms over HTTP, for a share of the driver's actions (the harness
    # sets them to its console process's); None: the Python API does them all.
    hands: ConsoleHands | None = None
    app: str = APP
    fleet: Fleet = program_flows.fleet
    pruned: Counter[str] = field(default_factory=Counter)
    _client: Fleet | None = None
    _next_look: float = 0.0
    _next_prune: float = 0.0

    def prepare(self, workdir: Path, say: Callable[[str], None]) -> None:
        progs = (
            [P.generate(self.seed, i) for i in self.indices]
            if self.indices
            else P.programs(self.seed, self.count)
        )
        self.count = len(progs)
        for prog in progs:
            root = root_id(self.seed, prog["index"])
            wants = bool(self.prune_every) and not self.indices and prog["index"] % RERUN_EVERY == 0
            self.entries.append(Entry(root, prog, wants_rerun=wants, resolved=not wants))
        kinds = sum((P.op_counts(e.prog) for e in self.entries), Counter())
        reruns = sum(e.wants_rerun for e in self.entries)
        say(
            f"  {self.count} programs (and up to {reruns} reruns of a pruned root id), "
            f"{sum(kinds.values())} ops: {dict(sorted(kinds.items()))}"
        )

    def env(self, workdir: Path) -> dict[str, str]:
        # The sweeper's retention too, behind the harness's prunes: a tree is captured
        # within seconds of its end, long before this.
        return {
            "FLEET_CHAOS_LIMIT_LOG": str(workdir / "limits.jsonl"),
            "FLEET_RETENTION": f"{SWEEPER_RETENTION}s",
        }

    def enqueue(self, client: Fleet) -> None:
        self._client = client
        self.driver = Driver(client, hands=self.hands, rng=random.Random(f"driver-{self.seed}"))
        self._fill(client)

    def _fill(self, client: Fleet) -> None:
        """Enqueue programs not started yet until ``window`` are live (or all of them)."""
        live = sum(e.enqueued and e.captured is None for e in self.entries)
        for entry in self.entries:
            if self.window and live >= self.window:
                return
            if not entry.enqueued and not entry.rerun:
                self._start(client, entry)
                live += 1

    def _start(self, client: Fleet, entry: Entry) -> None:
        assert self.driver is not None
        client.enqueue(P.WORKFLOW, entry.prog, run_id=entry.root, budget=entry.prog["budget"])
        entry.enqueued = True
        self.driver.watch(expected(entry.prog, entry.root))

    def done(self) -> bool:
        """Every entry enqueued has been captured and every rerun due has been made."""
        return all(e.enqueued and e.resolved and e.captured is not None for e in self.entries)

    def progress(self) -> int:
        """A count that grows as programs are enqueued, end and are captured."""
        return sum(e.enqueued + (e.captured is not None) for e in self.entries)

    def tick(self) -> None:
        if self.driver is None or self._client is None:
            return
        self.driver.tick()
        if time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + LOOK_EVERY
        looked = time.time()
        try:
            self._capture(self._client)
            self._fill(self._client)
        except Exception:  # the store is restarting: look again next time
            self.pruned["capture_errors"] += 1
            return
        if not self.prune_every or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + self.prune_every
        # Only what finished before this look began: every tree that had ended by then
        # has been captured.
        try:
            pruned = self.prune(math.ceil(time.time() - looked))
            self._reruns(self._client, looked)
        except Exception:
            self.pruned["prune_errors"] += 1
        else:
            self.pruned["runs"] += pruned
            self.pruned["prunes"] += 1

    def _capture(self, client: Fleet) -> None:
        """Capture each tree not captured yet whose root has ended and nothing is live."""
        for entry in self.entries:
            if not entry.enqueued or entry.captured is not None:
                continue
            run = client.runtime.queries.run(entry.root)
            if run is None or str(run.status) in LIVE:
                continue
            entry.captured = capture_tree(client, entry.root)
            if entry.captured is not None:
                entry.captured_at = time.time()
                self._replay(client, entry)

    def _replay(self, client: Fleet, entry: Entry) -> None:
        """Replay through the console the step the faults killed (``replayable``), once
        per entry: the tree is then captured again when it ends once more."""
        if self.hands is None or self.driver is None or entry.before_replay is not None:
            return
        target = replayable(entry.captured or [], entry.root)
        letter = letter_of(client, *target) if target else None
        if letter is None:
            return
        try:
            self.hands.replay(letter)
        except (Conflict, Unreachable) as exc:
            self.driver.counts[f"console_replay_{type(exc).__name__}"] += 1
            return
        self.driver.counts["console_replay"] += 1
        entry.before_replay, entry.captured = entry.captured, None

    def _reruns(self, client: Fleet, looked: float) -> None:
        """After a prune: each captured entry that wants a rerun gets it if its root id
        is gone, or never if retention kept its tree (a dead letter not replayed)."""
        assert self.driver is not None
        for entry in list(self.entries):
            if entry.resolved or entry.captured is None or entry.captured_at > looked:
                continue
            entry.resolved = True
            if client.runtime.queries.run(entry.root) is not None:
                self.pruned["kept, no rerun"] += 1
                continue
            self.driver.forget(entry.root)
            again = Entry(entry.root, rerun_program(self.seed, entry.prog["index"]), rerun=True)
            again.resolved = True
            self.entries.append(again)
            self._start(client, again)
            self.pruned["reruns"] += 1

    def analyse(
        self,
        client: Fleet,
        faults: list[Fault],
        log: Path,
        provider: Path,
        stopped_at: float,
    ) -> Report:
        report = Report(self.seed, self.count, faults)
        calls = provider_calls(str(provider))
        applied = applications(calls)
        captures: list[dict[str, Any]] = []
        enqueued = [e for e in self.entries if e.enqueued]
        for entry in enqueued:
            prog, root = entry.prog, entry.root
            caps = entry.captured or capture_tree(client, root)
            if caps is None:
                report.lost.append(f"{root}: not ended\n{_as_stored(client, root)}")
                continue
            captures += caps
            died = died_of_faults(caps)
            exp = expected(prog, root, died)
            seen = {c["run"]: observed(c) for c in caps}
            found = differences(exp, seen, _mine(applied, entry.rerun))
            name = f"program {prog['index']}" + (" (rerun)" if entry.rerun else "")
            if found:
                before = (
                    f"  before its replay from the console:\n{history(entry.before_replay)}\n"
                    if entry.before_replay
                    else ""
                )
                report.differing.append(
                    f"{name} ({root}; died {sorted(died)}): {found}\n"
                    f"    {json.dumps(prog)}\n{before}{history(caps)}"
                )
            if self.verbose:
                self.say(f"{name} ({root}): {json.dumps(prog)}")
                for run_id, want in exp.runs.items():
                    end = want.error if want.status != "succeeded" else json.dumps(want.result)
                    self.say(f"  model: {run_id} {want.status}: {end}")
                self.say(history(caps))
                self.say(f"  differences: {found or 'none'}")
            report.extra["died_of_faults"] = report.extra.get("died_of_faults", 0) + len(died)
        report.checks["settled"] = check_settled(captures)
        report.checks["replay"] = check_replays(captures)
        report.checks["limit overlap"] = _overlap(log.parent / "limits.jsonl", faults, stopped_at)
        events = read_lines(log)
        excused = called_after_freeze(events, faults)
        per_key = Counter(c["key"] for c in calls)
        report.provider_calls = len(calls)
        report.zombie_calls = sum(excused.values())
        report.applied_twice = sorted(k for k, n in per_key.items() if n - excused[k] > 1)
        report.applied_twice += sorted(k for k, n in applied.items() if n > 1)
        ops = sum((P.op_counts(e.prog) for e in enqueued), Counter())
        report.extra.update(
            programs=len(enqueued),
            reruns=sum(e.rerun for e in enqueued),
            runs=len(captures),
            ops=dict(sorted(ops.items())),
            ends=dict(Counter(c["status"] for c in captures)),
            driver=dict(self.driver.counts) if self.driver else {},
            retention=dict(self.pruned),
        )
        with client.runtime.db.engine.connect() as conn:
            steps = {
                (s.run_id, s.step_id): s
                for s in conn.execute(text("SELECT run_id, step_id, name, epoch FROM fleet_steps"))
            }
        for c in captures:  # the steps of runs pruned since, as captured
            for step in c["steps"]:
                steps.setdefault(
                    (c["run"], step["id"]),
                    SimpleNamespace(name=step["name"], epoch=step["epoch"]),
                )
        known = {
            (c["run"], step["id"], t["epoch"]): t["outcome"]
            for c in captures
            for step in c["steps"]
            for t in step["tries"]
        }
        limited = frozenset(
            (e["run"], e["step"])
            for e in read_lines(log.parent / "limits.jsonl")
            if e["limit"] == P.CONC_LIMIT
        )
        common_figures(
            report, client, faults, events, steps, stopped_at, known=known, limited=limited
        )
        return report


def _overlap(path: Path, faults: list[Fault], stopped_at: float) -> list[str]:
    """The concurrency limit's overlaps at the provider, but those that began inside the
    restore gap after a Redis flush or restart."""
    stopped: dict[int, list[float]] = defaultdict(list)
    for f in faults:
        if f.kind in (KILL, FREEZE) and f.pid is not None:
            stopped[f.pid].append(f.at)
    gaps = [(f.at, f.until + RESTORE_GAP) for f in faults if f.kind in (FLUSHALL, REDIS_RESTART)]
    capacities = {P.CONC_LIMIT: P.CONCURRENCY}
    return check_overlap(read_lines(path), capacities, stopped, stopped_at, excused=gaps)
