"""Every benchmark that has a target, at a small size, in a few minutes (issue 51): run
it before an engine change is resolved, so that no figure goes stale again.

Each benchmark runs as its own subprocess (``python -m bench.quick --child NAME ARGS``:
the module run as ``python -m bench.NAME ARGS`` would run it, its JSON written to
``bench/out/quick/NAME.json`` so that a quick run never overwrites a full run's
``bench/out/NAME.json``; its output in ``bench/out/quick/NAME.log``). Its headline
figures are read from that JSON; each target is the one the module itself saves or
prints (its "target" lines), judged as it judges it (on the median of its repetitions).
A figure whose module names no target is printed with "—".

    .venv/bin/python -m bench.quick [--only sequential,fanout] [--list] [--reread]

The sizes are small (``QUICK``: a few repetitions, fewer runs, steps and items), so a
ratio here is a hint, not the figure: one measured below the module's full size (not
only repeated fewer times) is marked SMALL in the table. ``--reread`` prints the table
of the last run again from its logs and JSON, running nothing. Ends with one table, also written to
``bench/out/quick.json``. A measurement, never a test: the exit status is 0 whatever
the targets say, and 1 only if a benchmark crashed or printed no figure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import runpy
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import OUT, ROOT, host_pace

QUICK_OUT = OUT / "quick"
TIMEOUT = 600.0  # seconds one benchmark may take before it is interrupted
NO_TARGET = "—"


@dataclass
class Figure:
    """One headline figure of one benchmark, beside its target."""

    name: str
    value: float
    shown: str
    target: str = NO_TARGET
    verdict: str = NO_TARGET


@dataclass
class Result:
    """One benchmark's run: its command, time, status and figures."""

    bench: str
    size: str
    small: bool
    command: str
    seconds: float | None = None  # None: not run here (``--reread``)
    status: str = "not run"
    error: str = ""
    figures: list[Figure] = field(default_factory=list)


Collect = Callable[[dict[str, Any], str], list[Figure]]


@dataclass(frozen=True)
class Bench:
    """A benchmark module, the arguments it runs with here, what they leave out
    (``size``; ``small``: the measurement itself is smaller than the module's full
    size, not only repeated fewer times), how its figures are read and the name its
    JSON is saved under."""

    module: str
    args: tuple[str, ...]
    size: str
    collect: Collect
    small: bool = True
    saved: str = ""

    @property
    def json_name(self) -> str:
        return self.saved or self.module


# --- targets: as each module saves or prints them ----------------------------------------

SHOWN_OPS = {"==": "="}
OPS = {">=": ">=", "≥": ">=", "<=": "<=", "≤": "<=", "<": "<", ">": ">", "": "=="}
PRINTED = re.compile(r"target\s+(?:ratio\s+)?(>=|<=|≥|≤|<|>)?\s*(\d+(?:\.\d+)?)")


def printed_target(stdout: str, label: str) -> tuple[str, float]:
    """The target on the first line of ``stdout`` that holds ``label`` and a target
    (``target >= 2.0``, ``target ≤ 1.5×``, ``target 0``): its comparison and number."""
    for line in stdout.splitlines():
        if label in line and (found := PRINTED.search(line)):
            return OPS[found.group(1) or ""], float(found.group(2))
    raise LookupError(f"no printed target on a line with {label!r}")


def judged(value: float, op: str, target: float) -> str:
    if math.isnan(value):
        return "n/a"
    ok = {
        ">=": value >= target,
        "<=": value <= target,
        "<": value < target,
        ">": value > target,
        "==": value == target,
    }[op]
    return "met" if ok else "MISSED"


def figure(
    name: str,
    value: float,
    places: int,
    stdout: str | None = None,
    label: str = "",
    saved: float | None = None,
    op: str = "",
) -> Figure:
    """A figure, ``places`` decimals shown, judged against its module's target: the
    comparison printed on the line holding ``label`` (or ``op``) and the number saved in
    its JSON (``saved``) if any, else the printed one. Without ``label`` or ``op``: no
    target. Shown with more decimals where the rounded value would read the other way
    (0.797 against >= 0.8 is not "0.80")."""
    shown = "n/a" if math.isnan(value) else f"{value:.{places}f}"
    if stdout is not None and label:
        op, number = printed_target(stdout, label)
        number = number if saved is None else float(saved)
    elif op and saved is not None:
        number = float(saved)
    else:
        return Figure(name, value, shown)
    verdict = judged(value, op, number)
    while shown != "n/a" and judged(float(shown), op, number) != verdict and places < 6:
        places += 1
        shown = f"{value:.{places}f}"
    return Figure(name, value, shown, f"{SHOWN_OPS.get(op, op)} {number:g}", verdict)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- each benchmark's figures ------------------------------------------------------------


def sequential(saved: dict[str, Any], out: str) -> list[Figure]:
    reps = saved["reps"]
    targets = saved["targets"]
    figs = [
        figure(key, median([r[key] for r in reps]), 2, out, key, targets[key])
        for key in ("fleet/DBOS", "fleet/celery")
    ]
    for name, key, label in (
        ("store xacts/step", "xacts_per_step", "fleet store xacts/step"),
        ("broker messages/step", "messages_per_step", "fleet broker messages/step"),
    ):
        figs.append(figure(name, median([r["fleet"][key] for r in reps]), 2, out, label))
    return figs


def many_runs(saved: dict[str, Any], out: str) -> list[Figure]:
    value = median([r["fleet/celery"] for r in saved["reps"]])
    return [figure("fleet/celery", value, 2, out, "fleet/celery", saved["target"])]


def fanout(saved: dict[str, Any], out: str) -> list[Figure]:
    value = median([r["ratio"] for r in saved["reps"]])
    return [figure("map / single-step runs", value, 2, out, "map/single", saved["target"])]


def children(saved: dict[str, Any], out: str) -> list[Figure]:
    value = median([r["ratio"] for r in saved["reps"]])
    label = "parent/independent"
    return [figure("parent / independent runs", value, 2, out, label, saved["target"])]


def pool_ratio(saved: dict[str, Any], out: str) -> list[Figure]:
    """``bench.io_bound``'s report (``bench.async_steps`` prints the same): per
    configuration, achieved steps/s over the limit its slots allow."""
    figs = []
    for row in saved["summary"]:
        if row["hung"]:
            raise RuntimeError(f"{row['label']} hung: {row['hung']}")
        name = f"{row['label']}: of the {row['limit']:.0f}/s limit"
        figs.append(figure(name, row["ratio_median"], 2, out, "I/O-bound agents"))
    return figs


def recovery(saved: dict[str, Any], out: str) -> list[Figure]:
    figs = []
    for lease, row in saved["leases"].items():
        # The bound the module prints beside its figure (not a target).
        bound = float(lease) + saved["sweep_interval"]
        name = f"SIGKILL → step again, s, lease {float(lease):g} s (bound ≈ {bound:g} s)"
        if len(row["seconds"]) == 1:
            figs.append(figure(name, row["median"], 2))
        else:
            figs.append(figure(f"{name}, median", row["median"], 2))
            figs.append(figure(f"{name}, max", row["max"], 2))
    return figs


def waiting(saved: dict[str, Any], out: str) -> list[Figure]:
    held = saved["park"]["held_while_parked"]
    solo = saved["fresh"]["held_on_solo_worker"]
    # As the module counts them: tasks active and leases held while the runs wait, and
    # tasks active on the concurrency-1 worker that ran a fresh run past them.
    slots = held["active_tasks"] + held["leases_held"] + solo["active_tasks"]
    label = "slots held while waiting"
    p99 = median([s["to_step_p99_ms"] for s in saved["latency"]])
    return [
        figure("worker slots held while waiting", slots, 0, out, label),
        figure("signal → next step started, p99 ms", p99, 0),
    ]


def long_runs(saved: dict[str, Any], out: str) -> list[Figure]:
    figs = []
    for config, row in saved["runs"].items():
        steps = row["ms_per_step"]
        first, last = min(steps, key=int), max(steps, key=int)
        a, b = median(steps[first]), median(steps[last])
        figs.append(
            Figure(
                f"{config}: a step at {int(last):,} / at {int(first):,}",
                b / a,
                f"{b / a:.2f} ({a:.1f} → {b:.1f} ms)",
            )
        )
    return figs


def transcripts(saved: dict[str, Any], out: str) -> list[Figure]:
    figs = []
    for turns, slowdown in saved["slowdown"].items():
        n = int(turns)
        figs.append(
            figure(
                f"turn {n:,}: transcript / nothing, wall",
                slowdown,
                2,
                out,
                f"turn {n:,}: transcript",
            )
        )
    for turns, slowdown in saved["slowdown_cpu_without_read"].items():
        name = f"turn {int(turns):,}: the same in CPU, the body's read aside"
        figs.append(figure(name, slowdown, 2))
    # The store/raw target is the module's constant (it prints none beside the ratio).
    target = getattr(importlib.import_module("bench.transcripts"), "TARGET_RATIO", None)
    for row in saved["storage"]:
        if row["variant"] == "transcript":
            name = f"{row['turns']:,} turns: store / raw message bytes"
            figs.append(figure(name, row["ratio"], 2, saved=target, op="<="))
    return figs


def web(saved: dict[str, Any], out: str) -> list[Figure]:
    value = median([r["async_lag_p99_ms"] for r in saved["reps"]])
    return [figure("aenqueue: loop late p99 ms", value, 1, out, "async: endpoint p99")]


def limits(saved: dict[str, Any], out: str) -> list[Figure]:
    f = saved["figures"]
    return [
        figure("429s, % of requests", f["pct_429"], 1, out, "429s"),
        figure("throughput, of the limit", f["throughput_ratio"], 2, out, "of the limit"),
        figure(
            "slots held by throttled steps, mean",
            f["throttled_slots_mean"],
            2,
            out,
            "slots held by throttled steps",
        ),
        figure(
            "small tenant: with big / alone",
            f["fair_share_ratio"],
            2,
            out,
            "small tenant: with big / alone",
        ),
    ]


# Sizes chosen so that the whole takes about five minutes on a 2-core host.
QUICK = (
    Bench("sequential", ("--reps", "1"), "500 steps, 1 of 3 reps", sequential, False),
    Bench("many_runs", ("--reps", "1", "--runs", "100"), "100 runs (full: 200)", many_runs),
    Bench("fanout", ("--items", "1000"), "1,000 items (full: 10,000)", fanout, saved="fanout_1000"),
    Bench("children", ("--reps", "1"), "20 children, 1 of 3 reps", children, False),
    Bench(
        "async_steps",
        ("--only", "async 500 on 8 slots", "--reps", "1", "--runs", "200", "--steps", "10"),
        "200 runs x 10 steps (full: 500 x 20)",
        pool_ratio,
    ),
    Bench(
        "io_bound",
        ("--only", "threads", "--reps", "1", "--runs", "50", "--steps", "5"),
        "50 runs x 5 steps (full: 100 x 20)",
        pool_ratio,
    ),
    Bench("recovery", ("--leases", "2", "--reps", "1"), "lease 2 s, 1 of 5 reps", recovery, False),
    Bench(
        "waiting",
        ("--runs", "200", "--sample", "50", "--reps", "1"),
        "200 parked, 50 signals (full: 10,000, 500)",
        waiting,
    ),
    Bench(
        "long_runs",
        ("--steps", "1000", "--store", "postgres", "sqlite", "--live", "256", "--warm", "200"),
        "1,000 steps (full: 5,000)",
        long_runs,
    ),
    Bench(
        "transcripts",
        ("--turns", "200", "--quadratic", "", "--window", "200"),
        "200 turns (full: 100, 1,000, 5,000)",
        transcripts,
    ),
    Bench("web", ("--requests", "100", "--reps", "1"), "100 requests (full: 200)", web),
    Bench(
        "limits",
        ("--limits", "on", "--per-tenant", "4", "--window", "10", "--rpm", "50")
        + ("--tpm", "10000", "--big", "8", "--small", "2", "--calls", "10"),
        "10 s window, 8+2 runs x 10 calls (full: 60 s, 38+2 x 20)",
        limits,
        saved="limits_on",
    ),
)


# --- running them ------------------------------------------------------------------------


def child(module: str, argv: list[str]) -> None:
    """Run ``bench.<module>`` as ``python -m`` would, its JSON saved under QUICK_OUT."""
    from bench import common

    common.OUT = QUICK_OUT
    sys.argv = [module, *argv]
    runpy.run_module(f"bench.{module}", run_name="__main__", alter_sys=True)


def run(bench: Bench, reread: bool = False) -> Result:
    """One benchmark in a subprocess; its figures, or why there are none. ``reread``:
    no subprocess, the figures of the last run's log and JSON."""
    argv = [sys.executable, "-m", "bench.quick", "--child", bench.module, *bench.args]
    result = Result(
        bench.module,
        bench.size,
        bench.small,
        f"python -m bench.{bench.module} {shlex.join(bench.args)}",
    )
    saved = QUICK_OUT / f"{bench.json_name}.json"
    log = QUICK_OUT / f"{bench.module}.log"
    code: int | None = 0 if log.exists() else 1
    if not reread:
        saved.unlink(missing_ok=True)
        started = time.perf_counter()
        code = spawn(argv, log)
        result.seconds = time.perf_counter() - started
    stdout = log.read_text(errors="replace") if log.exists() else ""
    if code is None:
        result.status, result.error = "TIMEOUT", f"interrupted after {TIMEOUT:.0f} s"
    elif code != 0:
        result.status, result.error = "CRASHED", f"exit status {code}"
    elif not saved.exists():
        result.status, result.error = "CRASHED", f"no {saved.relative_to(ROOT)}"
    else:
        try:
            result.figures = bench.collect(json.loads(saved.read_text()), stdout)
            result.status = "ok"
        except (KeyError, LookupError, ValueError, TypeError, RuntimeError) as exc:
            result.status, result.error = "NO FIGURE", f"{type(exc).__name__}: {exc}"
    if result.status != "ok":
        tail = "\n".join(stdout.splitlines()[-25:])
        print(f"  {result.status}: {result.error}; the end of {log}:\n{tail}", flush=True)
    return result


def spawn(argv: list[str], log: Path) -> int | None:
    """Run ``argv``, its output in ``log``: its exit status, None if it timed out."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # its context managers stop its workers
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return None
        except BaseException:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
            raise
    return code


def table(results: list[Result]) -> list[str]:
    rows = [("benchmark", "size", "figure", "value", "target", "result")]
    for r in results:
        size = f"{'SMALL' if r.small else 'full'}: {r.size}"
        if r.status != "ok":
            rows.append((r.bench, size, r.error, "", "", r.status))
        for f in r.figures:
            rows.append((r.bench, size, f.name, f.shown, f.target, f.verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [b.module for b in QUICK]
    p.add_argument("--only", default=",".join(names), help="comma-separated: " + ", ".join(names))
    p.add_argument("--list", action="store_true", help="print the commands and stop")
    p.add_argument(
        "--reread", action="store_true", help="run nothing: the table of the last run's output"
    )
    args = p.parse_args()
    chosen = [b for b in QUICK if b.module in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(names)
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    if args.list:
        for b in chosen:
            print(f"python -m bench.{b.module} {shlex.join(b.args)}")
        return 0
    QUICK_OUT.mkdir(parents=True, exist_ok=True)
    pace, load = host_pace(), os.getloadavg()
    print(
        f"bench-quick: {len(chosen)} benchmarks at small sizes; host pace {pace:.0f} ms, "
        f"load {load[0]:.1f} (bench.common.host_pace: more is slower); "
        f"logs and JSON in {QUICK_OUT.relative_to(ROOT)}/"
        + (" (--reread: the last run's, nothing run now)" if args.reread else ""),
        flush=True,
    )
    started = time.perf_counter()
    results = []
    for i, bench in enumerate(chosen, 1):  # one after another: they share Postgres and Redis
        print(f"[{i}/{len(chosen)}] bench.{bench.module} {shlex.join(bench.args)}", flush=True)
        results.append(run(bench, args.reread))
        r = results[-1]
        print(
            f"  {r.status}" + (f", {r.seconds:.0f} s" if r.seconds is not None else ""), flush=True
        )
    wall = time.perf_counter() - started
    print(
        f"\nbench-quick, {time.strftime('%Y-%m-%d %H:%M')}, "
        + ("reread " if args.reread else f"{wall:.0f} s ")
        + "(small sizes: hints, not figures; a measurement, not a test)"
    )
    for line in table(results):
        print(line)
    failed = [r.bench for r in results if r.status != "ok"]
    path = OUT / "quick.json"
    path.write_text(
        json.dumps(
            {
                "benchmark": "quick",
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                "wall_s": None if args.reread else wall,
                "reread": args.reread,
                "host_pace_ms": pace,
                "loadavg_before": load,
                "loadavg_after": os.getloadavg(),
                "failed": failed,
                "results": [asdict(r) for r in results],
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
    print(f"wrote {path.relative_to(ROOT)}")
    if failed:
        print(f"crashed or printed no figure: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
