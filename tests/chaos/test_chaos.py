"""The chaos run, small and seeded, in CI: generated programs (every op of
tests/chaos/programs.py) on three workers while every kind of fault strikes at least
once and retention prunes throughout, checked against the model and from the store;
on Postgres + Redis, and on the embedded default (SQLite and the filesystem broker:
kills, freezes and a flush of the queue folder). ``make chaos`` runs the full one. A
failure prints the seed and the command that reproduces it."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest

from tests.chaos import programs as P
from tests.chaos.faults import WEIGHTS
from tests.chaos.harness import EMBEDDED_KINDS, ChaosConfig, run_chaos
from tests.harness import require_services

pytestmark = pytest.mark.services

CI_SEED = 20261129
PROGRAMS = 60  # their ops cover every kind at CI_SEED (asserted below)


def _require_cluster_tools() -> None:
    missing = shutil.which("pg_createcluster") is None or os.geteuid() != 0
    if missing:
        message = "the chaos run needs root and pg_createcluster (Debian postgresql-common)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def _config(tmp_path, **kw) -> ChaosConfig:
    return ChaosConfig(
        seed=int(os.environ.get("FLEET_CHAOS_SEED", CI_SEED)),
        programs=PROGRAMS,
        step_seconds=0.2,
        gap=(0.6, 1.5),
        settle=150.0,
        workdir=tmp_path,
        keep=True,
        **kw,
    )


def test_the_ci_programs_use_every_op():
    ops = sum((P.op_counts(p) for p in P.programs(CI_SEED, PROGRAMS)), Counter())
    assert set(ops) == set(P.KINDS), sorted(set(P.KINDS) - set(ops))


def _check(report, cfg: ChaosConfig, tmp_path, kinds: set[str]) -> None:
    print(report.render())
    reproduce = f"reproduce with: {cfg.command()} (logs in {tmp_path})"
    assert report.ok, "; ".join(report.failures) + "\n" + reproduce
    assert report.extra["programs"] - report.extra["reruns"] == PROGRAMS and not report.lost
    assert report.extra["reruns"] > 0, "no root id was enqueued again after its prune"
    struck = {f.kind for f in report.faults}
    assert struck == kinds, f"only {sorted(struck)} struck before the runs ended; {reproduce}"
    # Every freeze waits for its steps to be taken over, so its zombies must meet the
    # fence; none fenced means the freeze tested nothing.
    assert report.zombies_fenced > 0, f"no frozen step's late write was fenced; {reproduce}"
    assert report.fenced_writes >= report.zombies_fenced
    # Retention ran while the programs did, and deleted some finished trees.
    assert report.extra["retention"].get("runs", 0) > 0, report.extra["retention"]
    assert report.checks and not any(report.checks.values())


@pytest.mark.timeout(900)
def test_programs_under_fire_on_postgres_and_redis(tmp_path):
    require_services()
    _require_cluster_tools()
    cfg = _config(tmp_path, faults=14)
    _check(run_chaos(cfg), cfg, tmp_path, set(WEIGHTS))


@pytest.mark.timeout(900)
def test_programs_under_fire_on_the_embedded_default(tmp_path):
    cfg = _config(tmp_path, faults=8, embedded=True)
    _check(run_chaos(cfg), cfg, tmp_path, set(EMBEDDED_KINDS))
