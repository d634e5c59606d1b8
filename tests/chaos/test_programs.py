"""Chaos programs and their model: the generator is deterministic and covers every op;
the model computes a hand-checked answer; a perturbed program is told apart; and the
decisive one, fault-free programs on real ``fleet worker`` processes on both stores,
with the driver acting, end exactly as the model says, every effect applied once."""

from __future__ import annotations

import json
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from fleet import Fleet, Settings
from fleet.testing import SWEEPER_READY, WORKER_READY, FleetProcess, sweeper_argv, worker_argv
from tests.chaos import program_flows
from tests.chaos import programs as P
from tests.chaos.driver import Driver, observe
from tests.chaos.model import (
    CANCEL_REASON,
    Expected,
    Observed,
    applications,
    differences,
    expected,
    stable_error,
)
from tests.chaos.probe import StoreProbe
from tests.harness import Backend
from tests.provider import provider_calls

SEED = 7  # its first 50 programs use every op, reach 2 cancels, nest 3 levels
APP = "tests.chaos.program_flows"
M = P.MODULUS


def _m(a: int, b: int) -> int:
    return (a * 31 + b * 17 + 7) % M


# --- the generator ------------------------------------------------------------------------


def test_a_program_is_the_same_whatever_was_generated_before_it():
    batch = P.programs(SEED, 30)
    assert [P.generate(SEED, i) for i in reversed(range(30))] == list(reversed(batch))
    assert P.generate(SEED, 3) != P.generate(SEED + 1, 3)
    assert json.loads(json.dumps(batch)) == batch  # JSON, as a workflow input is


def test_the_first_programs_of_a_seed_use_every_op_and_nest_three_levels_at_most():
    progs = P.programs(SEED, 60)
    seen: Counter[str] = Counter()
    for prog in progs:
        seen += P.features(prog)
        assert P.depth(prog) <= P.MAX_DEPTH
        ops = sum(P.op_counts(prog).values())
        assert 5 <= ops <= 25, (prog["index"], ops)
    wanted = {
        *P.KINDS,
        *(f"fail:{m}" for m in P.FAIL_MODES),
        "fail:async",
        "fail:uncaught",
        *(f"map:{h}" for h in P.HANDLES),
        *(f"parallel:{h}" for h in P.HANDLES),
        "map:failing",
        "parallel:failing",
        "parallel:child",
        *(f"signal:{m}" for m in P.SIGNAL_MODES),
        "detach:await",
        "detach:alone",
        "budget",
        "depth:3",
    }
    assert wanted <= set(seen), sorted(wanted - set(seen))
    sizes = sorted(sum(P.op_counts(p).values()) for p in progs)
    assert sizes[len(sizes) // 2] >= 5  # most programs have 5 ops or more


def test_the_command_line_prints_programs_and_their_figures(capsys):
    assert P.main(["--seed", str(SEED), "--count", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == P.programs(SEED, 3)
    assert P.main(["--seed", str(SEED), "--count", "5", "--stats"]) == 0
    figures = json.loads(capsys.readouterr().out.splitlines()[0])
    assert figures["programs"] == 5 and sum(figures["ops"].values()) > 0


# --- the model on hand-written programs ---------------------------------------------------


def test_the_model_folds_steps_caught_failures_and_returned_exceptions_by_hand():
    prog = {
        "start": 1,
        "ops": [
            {"op": "step", "id": "o1", "k": 2},
            {"op": "fail", "id": "o2", "k": 0, "mode": "raise", "async": False, "catch": True},
            {"op": "map", "id": "o3", "items": [[1, "ok"], [2, "nonretry"]], "handle": "return"},
            {"op": "fail", "id": "o4", "k": 5, "mode": "retry2", "async": True, "catch": False},
        ],
    }
    # o1: 1*31 + 2*17 + 7 = 72. o2 dies after 3 attempts, caught: 72*31 + 555555*17 + 7
    # = 9446674 = 446647 (mod 1000003). o3: item 1 gives (446647*31 + 2*17 + 7) mod M
    # = 846059, item 2 is dead (444): 446647 -> 228983 -> 106007. o4 succeeds on its
    # second attempt: (106007*31 + 106*17 + 7) mod M = 3288026 = 288017.
    assert [_m(1, 2), _m(72, P.CAUGHT), _m(446647, 2)] == [72, 446647, 846059]
    assert [_m(446647, 846059), _m(228983, P.FAILED), _m(106007, 106)] == [228983, 106007, 288017]
    exp = expected(prog, "r")
    assert exp.end.status == "succeeded"
    trail = [["o1", 72], ["o2", 446647], ["o3", 106007], ["o4", 288017]]
    assert exp.end.result == {"acc": 288017, "trail": trail}
    assert list(exp.runs) == ["r"] and exp.effects == {} and exp.signals == []


def test_the_model_words_a_failure_as_fleet_does_through_a_child():
    inner = {"op": "fail", "id": "o3", "k": 1, "mode": "nonretry", "async": False, "catch": False}
    prog = {
        "start": 7,
        "ops": [
            {"op": "effect", "id": "o1", "k": 4},
            {"op": "child", "id": "o2", "prog": {"ops": [inner]}, "catch": False},
            {"op": "step", "id": "o4", "k": 1},
        ],
    }
    exp = expected(prog, "root")
    leaf = "StepFailed: step o3 failed after 1 attempt(s): NonRetryable: refused o3"
    assert exp.runs["root/o2"].status == "failed" and exp.runs["root/o2"].error == leaf
    assert exp.end.error == f"StepFailed: child o2 failed: child run root/o2 failed: {leaf}"
    assert exp.effects == {"root:o1": 1}
    # A fault spent o3's attempts: an unknown count and error, written alike on both sides.
    died = expected(prog, "root", died={("root/o2", "o3")})
    observed = (
        "StepFailed: child o2 failed: child run root/o2 failed: StepFailed: step o3 failed "
        "after 2 attempt(s): AttemptsExhausted: all 2 attempt(s) were lost with their worker"
    )
    assert stable_error(observed, died.died) == died.end.error
    assert died.end.error.endswith("step o3 failed after * attempt(s): *")
    # An effect that died may have been applied once, or not at all.
    lost = expected(prog, "root", died={"o1"})
    assert lost.effects == {} and lost.maybe_effects == {"root:o1"}


def test_the_model_keeps_the_window_after_a_compaction_and_several_dead_branches():
    prog = {
        "start": 1,
        "ops": [
            {"op": "say", "id": "o1", "role": "user"},
            {"op": "say", "id": "o2", "role": "assistant"},
            {"op": "compact", "id": "o3", "keep": 1},
            {"op": "read", "id": "o4"},
            {
                "op": "parallel",
                "id": "o5",
                "branches": [
                    {"b": "fail", "k": 1, "mode": "raise", "async": False},
                    {"b": "step", "k": 2},
                    {"b": "fail", "k": 3, "mode": "retryx", "async": True},
                ],
                "handle": "raise",
            },
        ],
    }
    exp = expected(prog, "r")
    first = {"role": "user", "content": "o1 1"}  # acc 1 -> 1*31 + 1*17 + 7 = 55
    second = {"role": "assistant", "content": "o2 55"}
    assert exp.end.raw == [first, second]
    digest = zlib.crc32(json.dumps([first], sort_keys=True, separators=(",", ":")).encode())
    summary = {"role": "system", "content": f"summary of 1: {digest % 100_000}"}
    assert exp.end.window == [summary, second]
    assert exp.end.status == "failed"
    assert exp.end.error == (
        "StepFailed: 2 branches failed (o5.0, o5.2); the first: step o5.0 failed after "
        "3 attempt(s): ValueError: boom o5.0"
    )


def test_the_model_plans_the_drivers_signals_and_its_cancel_mid_fan_out():
    one = {"op": "step", "id": "o4", "k": 1}
    prog = {
        "start": 3,
        "ops": [
            {"op": "signal", "id": "o1", "v": 9, "mode": "after_id"},
            {"op": "timeout", "id": "o2", "secs": 0.3},
            {"op": "detach", "id": "o3", "prog": {"ops": [one]}, "await": False},
            {"op": "cancel", "id": "o5", "k": 2, "prog": {"ops": [{"op": "stuck", "id": "o6"}]}},
        ],
    }
    exp = expected(prog, "r")
    assert [(s.run_id, s.name, s.payload, s.mode) for s in exp.signals] == [
        ("r", "sig-o1", {"v": 9}, "after_id")
    ]
    assert exp.cancel is not None
    assert (exp.cancel.run_id, exp.cancel.stuck_run, exp.cancel.wait) == ("r", "r/o5.1", "stuck-o6")
    assert exp.cancel.settled == ("o5.0",)
    assert exp.end.status == "cancelled" and exp.end.error == f"cancelled: {CANCEL_REASON}"
    assert exp.runs["r/o5.1"].error == "cancelled: parent run r cancelled"
    assert exp.runs["r/o3"].status == "succeeded"  # detached: not cancelled with it


# --- a wrong answer is told apart -------------------------------------------------------------


def _as_observed(exp: Expected) -> dict[str, Observed]:
    return {
        run_id: Observed(end.status, end.result, end.error, end.raw, end.window)
        for run_id, end in exp.runs.items()
    }


def _perturbed(prog: dict[str, Any]) -> dict[str, Any] | None:
    """The program with the ``k`` of its first top-level plain step changed by one."""
    out = json.loads(json.dumps(prog))
    for op in out["ops"]:
        if op["op"] in ("step", "astep", "effect", "hog"):
            op["k"] += 1
            return out
    return None


def test_a_program_whose_flow_is_perturbed_is_told_apart_by_the_comparison():
    checked = 0
    for prog in P.programs(SEED, 80):
        exp = expected(prog, "r")
        applied = Counter(exp.effects)
        assert differences(exp, _as_observed(exp), applied) == []
        other = _perturbed(prog)
        if exp.end.status != "succeeded" or other is None:
            continue
        assert differences(expected(other, "r"), _as_observed(exp), applied), prog["index"]
        checked += 1
    assert checked >= 20
    exp = expected(P.generate(SEED, 1), "r")
    twice = Counter({k: 2 for k in exp.effects}) + Counter({"r:nowhere": 1})
    found = differences(exp, _as_observed(exp), twice)
    assert any("applied 1 times, expected 0" in d for d in found)
    assert all(any(k in d for d in found) for k in exp.effects)


# --- the decisive one: real workers, both stores ----------------------------------------------

PROGRAMS = 50


def _spawn(backend: Backend, env: dict[str, str], name: str, argv: list[str]) -> FleetProcess:
    return FleetProcess(name, argv, {**env, "FLEET_WORKER_NAME": name}, backend.workdir)


def _most_at_once(log: Path, limit: str) -> int:
    """The most attempts ever inside ``limit`` at once, from the enter/exit lines."""
    if not log.exists():
        return 0
    events = [json.loads(line) for line in log.read_text().splitlines() if line]
    marks = sorted(
        (e["t"], 1 if e["event"] == "enter" else -1) for e in events if e["limit"] == limit
    )
    inside = most = 0
    for _, delta in marks:  # at one instant an exit counts before an enter
        inside += delta
        most = max(most, inside)
    return most


def _unfinished(client: Fleet) -> str:
    """The runs not ended, each with its steps not finished: why a run hangs."""
    lines = []
    with client.runtime.db.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM fleet_runs WHERE status NOT IN (:s, :f, :c)"),
            {"s": "succeeded", "f": "failed", "c": "cancelled"},
        ).all()
    for run_id, status in rows:
        steps = [
            (s.step_id, s.kind, s.status, s.attempts)
            for s in client.runtime.queries.steps(run_id)
            if s.status not in ("done", "dead")
        ]
        lines.append(f"{run_id} {status}: {steps}")
    return f"{len(rows)} run(s) unfinished:\n" + "\n".join(lines) + "\n"


@pytest.mark.services
@pytest.mark.timeout(420)
def test_fault_free_programs_on_real_workers_end_as_the_model_says(backend: Backend):
    progs = P.programs(SEED, PROGRAMS)
    kinds = sum((P.op_counts(p) for p in progs), Counter())
    assert set(kinds) == set(P.KINDS), kinds
    limit_log = backend.workdir / "limits.jsonl"
    env = backend.env(
        FLEET_CHAOS_LOG=str(backend.workdir / "steps.jsonl"),
        FLEET_CHAOS_LIMIT_LOG=str(limit_log),
        FLEET_CHAOS_STEP_SECONDS="0.05",
    )
    client: Fleet = program_flows.fleet.with_settings(Settings.from_env(env))
    client.upgrade_schema()
    procs = [_spawn(backend, env, "sweeper", sweeper_argv(APP))]
    procs += [_spawn(backend, env, f"worker{i}", worker_argv(APP, 4)) for i in range(2)]
    try:
        for proc in procs:
            ready = SWEEPER_READY if proc.name == "sweeper" else WORKER_READY
            assert proc.wait_for_output(ready, 60), proc.output()[-3000:]
        driver = Driver(client)
        plans: dict[str, tuple[dict[str, Any], Expected]] = {}
        for prog in progs:
            root = f"cp-{SEED}-{prog['index']}"
            plans[root] = (prog, expected(prog, root))
            client.enqueue(P.WORKFLOW, prog, run_id=root, budget=prog["budget"])
            driver.watch(plans[root][1])
        probe = StoreProbe(client)
        started = time.monotonic()
        finished = driver.run_until(lambda: probe.unfinished() == 0, timeout=300)
        applied = applications(provider_calls(str(backend.provider_path)))
        failures = []
        for root, (prog, exp) in plans.items():
            found = differences(exp, observe(client, root), applied)
            if found:
                failures.append(f"program {prog['index']} ({root}): {found}\n  {json.dumps(prog)}")
        assert finished, _unfinished(client) + "\n".join(failures)
        assert not failures, "\n".join(failures)
        # The comparison can fail: the same runs against a model of perturbed programs.
        told = sum(
            1
            for root, (prog, exp) in plans.items()
            if exp.end.status == "succeeded"
            and (other := _perturbed(prog)) is not None
            and differences(expected(other, root), observe(client, root), applied)
        )
        assert told >= 10
        assert _most_at_once(limit_log, P.CONC_LIMIT) <= P.CONCURRENCY
        assert _most_at_once(limit_log, P.CONC_LIMIT) >= 1
        wanted = Counter(s.mode for _, e in plans.values() for s in e.signals)
        acted = driver.counts
        assert acted["signal_before"] == wanted["before"], acted
        assert acted["signal_after"] == wanted["after"], acted
        assert acted["signal_wait_id"] == wanted["after_id"], acted
        assert acted["cancel"] == sum(e.cancel is not None for _, e in plans.values()), acted
        took = time.monotonic() - started
        print(f"\n{backend.kind}: {PROGRAMS} programs in {took:.1f}s; driver {dict(acted)}")
        assert acted["cancel"] >= 1 and acted["budget_raise"] >= 1, acted
    finally:
        for proc in procs:
            proc.signal(9)
            proc.stop()
        client.runtime.db.dispose()


def test_the_driver_waits_out_a_store_it_cannot_reach(tmp_path):
    prog = {"start": 1, "ops": [{"op": "signal", "id": "o1", "v": 5, "mode": "after_id"}]}
    cancel = {"op": "cancel", "id": "o2", "k": 1, "prog": {"ops": [{"op": "stuck", "id": "o3"}]}}
    prog["ops"].append(cancel)
    settings = Settings(
        database_url="postgresql+psycopg://postgres@127.0.0.1:1/nowhere",
        broker_url=f"filesystem:///{tmp_path}/broker",
    )
    client = program_flows.fleet.with_settings(settings)
    driver = Driver(client, poll=0.0)
    driver.watch(expected(prog, "r"))
    assert driver.pending() == 2
    for _ in range(3):
        assert driver.tick() == 0  # nothing done, nothing raised: tried again next time
    assert driver.pending() == 2 and driver.counts["store_errors"] == 6
