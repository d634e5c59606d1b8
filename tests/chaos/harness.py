"""One chaos run: a workload on 3+ real workers against a private Postgres + Redis while
the seeded injector strikes, then the report. ``python -m tests.chaos --help`` runs it.

Two workloads: ``mixed`` (the first week's: runs of one 16-step workflow, compared with
a fault-free reference run of the same inputs, in process on SQLite) and, with
``programs`` > 0, generated programs compared with their model (program_chaos.py)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet import Fleet, Settings
from fleet.testing import SWEEPER_READY, FleetProcess, sweeper_argv
from tests.chaos import flows, mutants
from tests.chaos.console_hands import ConsoleHands, ConsoleProcess
from tests.chaos.crew import APP, Crew
from tests.chaos.faults import DUPLICATE, FLUSHALL, FREEZE, KILL, Fault
from tests.chaos.injector import Injector, Plan
from tests.chaos.probe import StoreProbe
from tests.chaos.program_chaos import ProgramWorkload
from tests.chaos.proxy import Proxy
from tests.chaos.report import Report, analyse
from tests.chaos.services import EmbeddedBroker, EmbeddedStore, PrivatePostgres, PrivateRedis
from tests.harness import Backend, InlineBroker

SWEEP_GRACE = 1.0
# The faults of the embedded default: no server to restart; a flush empties the broker's
# queue folder.
EMBEDDED_KINDS = (KILL, FREEZE, FLUSHALL, DUPLICATE)


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
    programs: int = 0  # > 0: this many generated programs instead of ``runs`` mixed runs
    # The embedded default (a SQLite file, Celery's filesystem transport) instead of a
    # private Postgres + Redis: only the faults that apply to it (EMBEDDED_KINDS).
    embedded: bool = False
    window: int = 100  # programs live at once (0: every program enqueued at the start)
    indices: list[int] | None = None  # only these programs of the seed
    verbose: bool = False  # each program's model and history in the output

    def fault_kinds(self) -> list[str] | None:
        """The kinds of fault to draw from (None: every kind)."""
        if not self.embedded:
            return self.kinds
        wrong = sorted(set(self.kinds or ()) - set(EMBEDDED_KINDS))
        if wrong:
            raise ValueError(f"fault kind(s) {wrong} do not apply to the embedded default")
        return self.kinds or list(EMBEDDED_KINDS)

    def command(self) -> str:
        size = f"--programs {self.programs}" if self.programs else f"--runs {self.runs}"
        if self.indices:
            size = "--index " + " ".join(map(str, self.indices))
        elif self.programs:
            size += f" --window {self.window}"
        return (
            f"python -m tests.chaos --seed {self.seed} {size} "
            f"--faults {self.faults} --workers {self.workers} "
            f"--concurrency {self.concurrency} --step-seconds {self.step_seconds} "
            f"--lease {self.lease_seconds}"
            + (f" --kinds {' '.join(self.kinds)}" if self.kinds else "")
            + (f" --mutant {self.mutant}" if self.mutant else "")
            + (" --embedded" if self.embedded else "")
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


@dataclass
class MixedWorkload:
    """``runs`` runs of the 16-step ``mixed`` workflow, each on a seeded input."""

    seed: int
    runs: int
    rng: random.Random
    jobs: dict[str, int] = field(default_factory=dict)
    reference: dict[int, Any] = field(default_factory=dict)
    app: str = APP
    fleet: Fleet = flows.fleet

    def prepare(self, workdir: Path, say: Callable[[str], None]) -> None:
        self.jobs = {
            f"chaos-{self.seed}-{i}": self.rng.randrange(1, 1_000_000) for i in range(self.runs)
        }
        started = time.monotonic()
        self.reference = reference_outputs(list(self.jobs.values()), workdir / "reference")
        took = time.monotonic() - started
        say(f"  fault-free reference of {len(self.reference)} inputs: {took:.1f}s")

    def env(self, workdir: Path) -> dict[str, str]:
        return {}

    def enqueue(self, client: Fleet) -> None:
        for rid, job in self.jobs.items():
            client.enqueue("mixed", job, run_id=rid)

    def tick(self) -> None:
        pass

    def done(self) -> bool:
        return True

    def progress(self) -> int:
        return 0

    def analyse(
        self, client: Fleet, faults: list[Fault], log: Path, provider: Path, stopped_at: float
    ) -> Report:
        return analyse(
            client, self.seed, self.jobs, self.reference, faults, log, provider, stopped_at
        )


Workload = MixedWorkload | ProgramWorkload


class Pruner:
    """``tests.chaos.pruner`` in a process started with the workers' environment: the
    harness's retention, run by the engine the workers run. ``prune(seconds)`` →
    runs deleted; raises if the pruner answered an error (the store unreachable)."""

    def __init__(self, app: str, env: dict[str, str], workdir: Path) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.pruner", app],
            env=env,
            cwd=workdir,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the pruner did not start: {ready!r}")

    def prune(self, seconds: int) -> int:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{max(1, seconds)}\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline().strip()
        if not answer.isdigit():
            raise RuntimeError(f"the pruner: {answer or 'no answer'}")
        return int(answer)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._proc.kill()
            self._proc.wait(10)


def _wait_for_runs(
    probe: StoreProbe, injector: Injector, settle: float, workload: Workload
) -> None:
    """Until every run has finished and the workload is done, or nothing has moved for
    ``settle`` seconds since the last fault (no run finished, no program captured or
    enqueued): a run still live then is lost. The workload ticks meanwhile (the
    driver's actions)."""
    settle_from: float | None = None
    seen: tuple[int | None, int] | None = None
    while True:
        workload.tick()
        unfinished = probe.unfinished()
        if unfinished == 0 and workload.done():
            return
        if not injector.is_alive():
            now = (unfinished, workload.progress())
            if now != seen:  # something moved: the settle time starts again
                seen, settle_from = now, time.monotonic()
            elif settle_from is not None and time.monotonic() - settle_from > settle:
                return
        time.sleep(0.25)


def run_chaos(cfg: ChaosConfig, say: Callable[[str], None] = print) -> Report:
    rng = random.Random(cfg.seed)
    workload: Workload = (
        ProgramWorkload(cfg.seed, cfg.programs, cfg.indices, cfg.verbose, say, window=cfg.window)
        if cfg.programs or cfg.indices
        else MixedWorkload(cfg.seed, cfg.runs, rng)
    )
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix=f"fleet-chaos-{cfg.seed}-"))
    say(f"chaos seed {cfg.seed} (reproduce: {cfg.command()}); logs in {workdir}")
    workload.prepare(workdir, say)

    pg: PrivatePostgres | EmbeddedStore
    redis: PrivateRedis | EmbeddedBroker
    if cfg.embedded:
        pg, redis = EmbeddedStore(workdir), EmbeddedBroker(workdir)
    else:
        pg, redis = PrivatePostgres(cfg.pg_port, cfg.cluster), PrivateRedis(cfg.redis_port, workdir)
    # The workers and the sweeper reach Postgres and Redis through proxies the injector
    # can cut; the harness's own client and probe go straight to them.
    proxies: dict[str, Proxy] = {}
    db_url, broker_url = pg.url, redis.url
    if isinstance(pg, PrivatePostgres) and isinstance(redis, PrivateRedis):
        proxies = {
            "postgres": Proxy(pg.port, "pg-proxy").start(),
            "redis": Proxy(redis.port, "redis-proxy").start(),
        }
        db_url = pg.url.replace(f":{pg.port}/", f":{proxies['postgres'].port}/")
        broker_url = redis.url.replace(f":{redis.port}/", f":{proxies['redis'].port}/")
    log = workdir / "steps.jsonl"
    backend = Backend(
        "sqlite" if cfg.embedded else "postgres",
        workdir,
        db_url,
        broker_url,
        lease_seconds=cfg.lease_seconds,
        extra_env={
            "FLEET_SWEEP_INTERVAL": "0.25",
            "FLEET_SWEEP_GRACE": str(SWEEP_GRACE),
            "FLEET_CHAOS_LOG": str(log),
            "FLEET_CHAOS_STEP_SECONDS": str(cfg.step_seconds),
            **mutants.engine_env(cfg.mutant, workdir),  # not the reference's, nor client's
            **workload.env(workdir),
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
    pruner: Pruner | None = None
    console: ConsoleProcess | None = None
    pg.start()
    try:
        redis.start()
        direct = {**env, "FLEET_DATABASE_URL": pg.url, "FLEET_BROKER_URL": redis.url}
        client = workload.fleet.with_settings(Settings.from_env(direct))
        client.upgrade_schema()
        probe = StoreProbe(client)
        sweeper = spawn("sweeper", sweeper_argv(workload.app))
        crew = Crew(spawn, cfg.workers, cfg.concurrency, workload.app)
        crew.wait_ready()
        if not sweeper.wait_for_output(SWEEPER_READY, 30):
            raise RuntimeError(f"sweeper did not start:\n{sweeper.output()[-3000:]}")
        if isinstance(workload, ProgramWorkload):
            pruner = Pruner(workload.app, env, workdir)
            workload.prune = pruner.prune
            console = ConsoleProcess(workload.app, env, workdir)
            workload.hands = ConsoleHands(console.url, console.secret)
        mutants.prove_planted(
            cfg.mutant, workdir, [*crew.pids(), sweeper.pid, *([pruner.pid] if pruner else [])]
        )
        workload.enqueue(client)
        t0 = time.monotonic()
        say(f"  enqueued on {cfg.workers} workers × {cfg.concurrency} threads")
        injector = Injector(
            rng,
            Plan.draw(rng, cfg.faults, cfg.gap, cfg.freeze_cap, cfg.fault_kinds()),
            crew,
            pg,
            redis,
            log,
            probe,
            say,
            proxies,
        )
        injector.start()
        _wait_for_runs(probe, injector, cfg.settle, workload)
        injector.finish()
        if injector.error is not None:
            raise RuntimeError(f"the injector failed: {injector.error!r}") from injector.error
        # A run still live here gets the settle time after the last thaw, too.
        _wait_for_runs(probe, injector, cfg.settle, workload)
        elapsed = time.monotonic() - t0
        stopped_at = time.time()
        crew.stop()
        report = workload.analyse(client, injector.faults, log, provider, stopped_at)
        report.seconds = elapsed
    finally:
        if crew is not None:
            crew.stop()
        if sweeper is not None:
            sweeper.signal(9)
            sweeper.stop()
        if pruner is not None:
            pruner.stop()
        if console is not None:
            console.stop()
        for proxy in proxies.values():
            proxy.close()
        redis.stop()
        pg.drop()
    if report.ok and not cfg.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return report
