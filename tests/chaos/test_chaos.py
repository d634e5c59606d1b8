"""The chaos run, small and seeded, in CI: 60 runs of the mixed workflow on three
workers while every kind of fault strikes at least once. ``make chaos`` runs the full
one. A failure prints the seed and the command that reproduces it."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.chaos.faults import WEIGHTS
from tests.chaos.harness import ChaosConfig, run_chaos
from tests.harness import require_services

pytestmark = pytest.mark.services

CI_SEED = 20261129


def _require_cluster_tools() -> None:
    missing = shutil.which("pg_createcluster") is None or os.geteuid() != 0
    if missing:
        message = "the chaos run needs root and pg_createcluster (Debian postgresql-common)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


@pytest.mark.timeout(900)
def test_nothing_lost_changed_or_done_twice_under_fire(tmp_path):
    require_services()
    _require_cluster_tools()
    cfg = ChaosConfig(
        seed=int(os.environ.get("FLEET_CHAOS_SEED", CI_SEED)),
        runs=60,
        faults=10,
        step_seconds=0.2,
        gap=(0.8, 2.0),
        settle=150.0,
        workdir=tmp_path,
        keep=True,
    )
    report = run_chaos(cfg)
    print(report.render())
    reproduce = f"reproduce with: {cfg.command()} (logs in {tmp_path})"
    assert report.ok, "; ".join(report.failures) + "\n" + reproduce
    struck = {f.kind for f in report.faults}
    assert struck == set(WEIGHTS), (
        f"only {sorted(struck)} struck before the runs ended; {reproduce}"
    )
    # Every freeze waits for its steps to be taken over, so its zombies must meet the
    # fence; none fenced means the freeze tested nothing.
    assert report.zombies_fenced > 0, f"no frozen step's late write was fenced; {reproduce}"
    assert report.fenced_writes >= report.zombies_fenced
