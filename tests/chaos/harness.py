"""One chaos run: a fault-free reference of the inputs (in process, on SQLite), then the
same inputs on 3+ real workers against a private Postgres + Redis while the seeded
injector strikes; then the report. ``python -m tests.chaos --help`` runs it."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet import Settings
from fleet.testing import SWEEPER_READY, FleetProcess, sweeper_argv
from tests.chaos import flows, mutants
from tests.chaos.crew import APP, Crew
from tests.chaos.injector import Injector, Plan
from tests.chaos.probe import StoreProbe
from tests.chaos.report import Report, analyse
from tests.chaos.services import PrivatePostgres, PrivateRedis
from tests.harness import Backend, InlineBroker

SWEEP_GRACE = 1.0


@dataclass
class ChaosConfig:
    seed: int
    runs: int = 300
    faults: int = 50
    workers: int = 3
    concurrency: int = 4
    step_seconds: float = 0.3
    lease_seconds: float = 2.0
    gap: tuple[float, float] = (1.0, 3.5)
    settle: float = 240.0  # after the last fault, how long the runs have to finish
    # A freeze lasts until a newer attempt has taken over every step body it caught;
    # this long at most (a re-sent step may queue behind a deep backlog).
    freeze_cap: float = 30.0
    workdir: Path | None = None
    # A private Postgres cluster and Redis: two chaos runs at once (one per worktree)
    # need their own, named by FLEET_CHAOS_CLUSTER / _PG_PORT / _REDIS_PORT.
    cluster: str = field(
        default_factory=lambda: os.environ.get("FLEET_CHAOS_CLUSTER", "fleetchaos")
    )
    pg_port: int = field(default_factory=lambda: int(os.environ.get("FLEET_CHAOS_PG_PORT", "5439")))
    redis_port: int = field(
        default_factory=lambda: int(os.environ.get("FLEET_CHAOS_REDIS_PORT", "6399"))
    )
    keep: bool = False  # keep the workdir (logs) even when every check passes
    kinds: list[str] | None = None  # fault kinds to inject (default: every kind)
    extra: dict[str, str] = field(default_factory=dict)
    mutant: str | None = None  # a planted bug the workers and sweeper run (mutants.py)

    def command(self) -> str:
        return (
            f"python -m tests.chaos --seed {self.seed} --runs {self.runs} "
            f"--faults {self.faults} --workers {self.workers} "
            f"--concurrency {self.concurrency} --step-seconds {self.step_seconds} "
            f"--lease {self.lease_seconds}"
            + (f" --kinds {' '.join(self.kinds)}" if self.kinds else "")
            + (f" --mutant {self.mutant}" if self.mutant else "")
        )


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def reference_outputs(jobs: list[int], folder: Path) -> dict[int, Any]:
    """Each job's output from a fault-free run of the same workflow, executed in this
    process on SQLite (wake-ups kept in a list, delivered in order)."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = Settings.from_env(
        {
            "FLEET_DATABASE_URL": f"sqlite:///{folder}/reference.db",
            "FLEET_BROKER_URL": f"filesystem:///{folder}/broker",
        }
    )
    client = flows.fleet.with_settings(settings)
    client.upgrade_schema()
    broker = InlineBroker(client)
    with _env(FLEET_TEST_PROVIDER=str(folder / "provider.jsonl"), FLEET_CHAOS_STEP_SECONDS="0"):
        handles = {job: client.enqueue("mixed", job) for job in set(jobs)}
        broker.drain(limit=10_000 * len(handles))
    return {job: h.wait(timeout=0) for job, h in handles.items()}


def _wait_for_runs(probe: StoreProbe, injector: Injector, settle: float) -> None:
    """Until every run has finished, or ``settle`` seconds after the last fault."""
    settle_from: float | None = None
    while True:
        if probe.unfinished() == 0:
            return
        if not injector.is_alive():
            settle_from = settle_from or time.monotonic()
            if time.monotonic() - settle_from > settle:
                return
        time.sleep(0.25)


def run_chaos(cfg: ChaosConfig, say: Callable[[str], None] = print) -> Report:
    rng = random.Random(cfg.seed)
    jobs = {f"chaos-{cfg.seed}-{i}": rng.randrange(1, 1_000_000) for i in range(cfg.runs)}
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix=f"fleet-chaos-{cfg.seed}-"))
    say(f"chaos seed {cfg.seed} (reproduce: {cfg.command()}); logs in {workdir}")
    started = time.monotonic()
    reference = reference_outputs(list(jobs.values()), workdir / "reference")
    say(f"  fault-free reference of {len(reference)} inputs: {time.monotonic() - started:.1f}s")

    pg, redis = PrivatePostgres(cfg.pg_port, cfg.cluster), PrivateRedis(cfg.redis_port, workdir)
    log = workdir / "steps.jsonl"
    backend = Backend(
        "postgres",
        workdir,
        pg.url,
        redis.url,
        lease_seconds=cfg.lease_seconds,
        extra_env={
            "FLEET_SWEEP_INTERVAL": "0.25",
            "FLEET_SWEEP_GRACE": str(SWEEP_GRACE),
            "FLEET_CHAOS_LOG": str(log),
            "FLEET_CHAOS_STEP_SECONDS": str(cfg.step_seconds),
            **mutants.engine_env(cfg.mutant, workdir),  # not the reference's, nor client's
            **cfg.extra,
        },
    )
    env, provider = backend.env(), backend.provider_path

    def spawn(name: str, argv: list[str]) -> FleetProcess:
        # PGAPPNAME names the process's Postgres sessions (the freeze looks them up).
        return FleetProcess(
            name, argv, {**env, "FLEET_WORKER_NAME": name, "PGAPPNAME": name}, workdir
        )

    crew: Crew | None = None
    sweeper: FleetProcess | None = None
    pg.start()
    try:
        redis.start()
        client = flows.fleet.with_settings(Settings.from_env(env))
        client.upgrade_schema()
        probe = StoreProbe(client)
        sweeper = spawn("sweeper", sweeper_argv(APP))
        crew = Crew(spawn, cfg.workers, cfg.concurrency)
        crew.wait_ready()
        if not sweeper.wait_for_output(SWEEPER_READY, 30):
            raise RuntimeError(f"sweeper did not start:\n{sweeper.output()[-3000:]}")
        mutants.prove_planted(cfg.mutant, workdir, [*crew.pids(), sweeper.pid])
        for rid, job in jobs.items():
            client.enqueue("mixed", job, run_id=rid)
        t0 = time.monotonic()
        say(f"  {cfg.runs} runs enqueued on {cfg.workers} workers × {cfg.concurrency} threads")
        injector = Injector(
            rng,
            Plan.draw(rng, cfg.faults, cfg.gap, cfg.freeze_cap, cfg.kinds),
            crew,
            pg,
            redis,
            log,
            probe,
            say,
        )
        injector.start()
        _wait_for_runs(probe, injector, cfg.settle)
        injector.finish()
        if injector.error is not None:
            raise RuntimeError(f"the injector failed: {injector.error!r}") from injector.error
        # A run still live here gets the settle time after the last thaw, too.
        _wait_for_runs(probe, injector, cfg.settle)
        elapsed = time.monotonic() - t0
        stopped_at = time.time()
        crew.stop()
        report = analyse(
            client, cfg.seed, jobs, reference, injector.faults, log, provider, stopped_at
        )
        report.seconds = elapsed
    finally:
        if crew is not None:
            crew.stop()
        if sweeper is not None:
            sweeper.signal(9)
            sweeper.stop()
        redis.stop()
        pg.drop()
    if report.ok and not cfg.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return report
