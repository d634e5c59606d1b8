"""``python -m tests.chaos``: the chaos run from the command line (``make chaos``).

``--replay SEED --index I [I ...]`` runs programs I of seed SEED alone on the same fleet
without faults and prints each one, the model's ends and the history of its runs: the
program of a failure, reproduced (the failure's own command, printed with it, runs the
same programs under the same faults again).

With ``--mutant NAME`` the workers and sweeper run a planted bug (tests/chaos/mutants.py)
and the run is expected to fail: it exits 0 if its checks caught the bug, 1 if not."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path

from tests.chaos import mutants
from tests.chaos.faults import WEIGHTS, fault_dicts
from tests.chaos.harness import ChaosConfig, run_chaos


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    p.add_argument("--runs", type=int, default=300, help="runs of the mixed workflow")
    p.add_argument(
        "--programs", type=int, default=0, help="generated programs instead of mixed runs"
    )
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--step-seconds", type=float, default=0.3)
    p.add_argument("--lease", type=float, default=2.0)
    p.add_argument(
        "--window", type=int, default=100, help="programs live at once (0: all at the start)"
    )
    p.add_argument(
        "--index", type=int, nargs="+", default=None, help="only these programs of the seed"
    )
    p.add_argument(
        "--replay",
        type=int,
        default=None,
        metavar="SEED",
        help="with --index: those programs of SEED alone, fault-free, printed in full",
    )
    p.add_argument(
        "--embedded",
        action="store_true",
        help="on the embedded default (SQLite + filesystem broker): kill, freeze, flushall",
    )
    p.add_argument("--kinds", nargs="+", default=None, help=f"some of {list(WEIGHTS)}")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the logs even on success")
    p.add_argument("--mutant", choices=list(mutants.MUTANTS), default=None, help="a planted bug")
    p.add_argument("--list-mutants", action="store_true", help="list the planted bugs")
    a = p.parse_args(argv)
    if a.list_mutants:
        print(mutants.table())
        return 0
    if a.replay is not None:
        if not a.index:
            p.error("--replay SEED needs --index I [I ...]: the programs to reproduce")
        a.seed, a.faults = a.replay, 0
    cfg = ChaosConfig(
        seed=a.seed if a.seed is not None else secrets.randbelow(10**6),
        runs=a.runs,
        faults=a.faults,
        workers=a.workers,
        concurrency=a.concurrency,
        step_seconds=a.step_seconds,
        lease_seconds=a.lease,
        keep=a.keep,
        kinds=a.kinds,
        mutant=a.mutant,
        programs=a.programs,
        embedded=a.embedded,
        indices=a.index,
        window=a.window,
        verbose=a.replay is not None,
    )
    report = run_chaos(cfg)
    print(report.render())
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        figures = {**report.figures(), "command": cfg.command()}
        if a.mutant:
            figures.update(mutant=a.mutant, caught=not report.ok)
        a.json.write_text(
            json.dumps({**figures, "fault_log": fault_dicts(report.faults)}, indent=2)
        )
    if a.mutant:
        verdict = "CAUGHT" if not report.ok else "NOT caught"
        print(f"mutant {a.mutant}: {verdict} by a run of {report.seconds:.1f}s ({cfg.command()})")
        return 0 if not report.ok else 1
    if not report.ok:
        print(f"chaos FAILED; reproduce with: {cfg.command()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
