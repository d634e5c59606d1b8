"""Where a step's time and store transactions go: one sequential run of no-op steps
driven in this process (``tests.harness.InlineBroker``: no broker, no Celery, no
worker), on a fresh Postgres database.

For every store method (``Ledger`` and ``Queries``) it counts calls, transactions,
statements, pool checkouts (each pings the server, a transaction as Postgres counts
it, only if its connection sat idle for a second or more) and wall time, per step; it
checks the transaction total against the database's own ``pg_stat_database``
counters; and it prints the cProfile functions that cost the most, by own time and
by cumulative time. With ``--trips``, round trips to the server are counted from libpq's
trace of the protocol (``tests.harness.Wire``; the trace slows every statement, so the
times are then not comparable).

    .venv/bin/python -m bench.profile_steps [--steps 500] [--messages] [--trips]
        [--cprofile [--top 25]]

Steps 1–N/2 are a warm-up; the counts are taken over the second half, where the
replay is longer (a step's cost grows with the run's length: see bench/long_runs.py).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.pool import Pool

from bench.common import delta, services, settled_pg_counters
from bench.cpu import CpuMeter
from bench.drivers import database_name
from fleet import Fleet, Settings
from fleet.store import driver, fused
from fleet.worker.inline import advance_steps, run_steps
from fleet.worker.replay import advance
from tests.harness import Wire


@dataclass
class Meter:
    """Per store method: calls, transactions (and those that wrote), statements,
    checkouts, seconds."""

    stack: list[str] = field(default_factory=lambda: ["(outside the store)"])
    calls: Counter[str] = field(default_factory=Counter)
    xacts: Counter[str] = field(default_factory=Counter)
    writes: Counter[str] = field(default_factory=Counter)
    statements: Counter[str] = field(default_factory=Counter)
    checkouts: Counter[str] = field(default_factory=Counter)
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))

    def reset(self) -> None:
        counters = (self.calls, self.xacts, self.writes, self.statements, self.checkouts)
        for counter in (*counters, self.seconds):
            counter.clear()

    def wrap(self, owner: Any, label: str) -> None:
        """Meter every public method of ``owner`` (an object, or a class for all its instances)."""
        for name in dir(owner):
            fn = getattr(owner, name)
            if name.startswith("_") or not callable(fn):
                continue
            setattr(owner, name, self._metered(f"{label}.{name}", fn))

    def _metered(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def metered(*args: Any, **kwargs: Any) -> Any:
            with self.timed(key):
                return fn(*args, **kwargs)

        return metered

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        self.stack.append(key)
        self.calls[key] += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[key] += time.perf_counter() - t0
            self.stack.pop()

    def listen(self) -> None:
        """Attribute every engine's transactions, statements and checkouts (in this
        process: the store's, which is rebuilt after each ``dispose``) to the method on
        top of the stack."""

        def xact(conn: Any) -> None:
            self.xacts[self.stack[-1]] += 1
            if conn.info.pop("wrote", False):
                self.writes[self.stack[-1]] += 1

        def statement(conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
            self.statements[self.stack[-1]] += 1
            head = sql.lstrip()[:6].upper()
            fused_write = head.startswith("WITH") and sql in _fused_writes(conn)
            if head in ("INSERT", "UPDATE", "DELETE") or fused_write:
                conn.info["wrote"] = True

        def checkout(*_: Any) -> None:
            self.checkouts[self.stack[-1]] += 1

        event.listen(Engine, "commit", xact)
        event.listen(Engine, "rollback", xact)
        event.listen(Engine, "before_cursor_execute", statement)
        event.listen(Pool, "checkout", checkout)


_FUSED_SQL: dict[tuple[str, str], frozenset[str]] = {}


def _fused_writes(conn: Any) -> frozenset[str]:
    """The SQL of the fused statements (all of which write) as the driver sends it,
    worked out once per dialect and driver (this runs at every statement metered)."""
    key = (conn.dialect.name, conn.dialect.driver)
    if key not in _FUSED_SQL:
        made = (
            (driver.compiled(stmt, conn) for stmt in fused.WRITES)
            if conn.dialect.name == fused.DIALECT
            else ()
        )
        _FUSED_SQL[key] = frozenset(m.sql for m in made if m is not None)
    return _FUSED_SQL[key]


def _client(database_url: str) -> tuple[Fleet, list[tuple[str, list[str]]]]:
    """The benchmark app on ``database_url`` with an in-process broker."""
    from bench import noop_flows
    from tests.harness import InlineBroker

    broker = tempfile.mkdtemp(prefix="fleet-bench-broker-")
    settings = Settings.from_env(
        {"FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": f"filesystem:///{broker}"}
    )
    client = noop_flows.fleet.with_settings(settings)
    client.upgrade_schema()
    return client, InlineBroker(client).sent


def _deliver(
    client: Fleet,
    sent: list[tuple[str, list[str]]],
    meter: Meter,
    executes: int | None = None,
    inline: bool = True,
) -> Counter[str]:
    """Deliver messages (all, or until ``executes`` steps have run), each under a meter
    key of its own; count them by task, and the steps run as ``step``. With ``inline``,
    a delivery runs the run's next steps itself, as a worker's task does (without its
    step and time caps)."""
    tasks: Counter[str] = Counter()
    while sent and (executes is None or tasks["step"] < executes):
        task, args = sent.pop(0)
        tasks[task] += 1
        with meter.timed(f"task {task}"):
            ran = tasks["step"]

            def more(n: int, ran: int = ran) -> bool:
                return inline and (executes is None or ran + n < executes)

            if task == "fleet.advance" and not inline:
                advance(client.runtime, args[0])  # the replay alone; its steps sent
            elif task == "fleet.advance":  # as the worker's task: the first step kept
                tasks["step"] += advance_steps(client.runtime, args[0], more=more)
            else:
                tasks["step"] += run_steps(client.runtime, args[0], args[1], more=more)
    return tasks


def _meter_heartbeat(meter: Meter) -> None:
    """An attempt registers its heartbeat and leaves it once per attempt: time that too."""
    from fleet.worker import heartbeat

    for name in ("__enter__", "__exit__"):
        original = getattr(heartbeat.Heartbeat, name)
        setattr(heartbeat.Heartbeat, name, meter._metered(f"Heartbeat.{name}", original))


def _table(meter: Meter, steps: int, total: float) -> None:
    keys = sorted(meter.calls, key=lambda k: -meter.seconds[k])
    print(
        f"  {'per step':<34} {'calls':>6} {'xacts':>6} {'writes':>6} {'stmts':>6} {'checkouts':>9}"
        f" {'ms':>7}"
    )
    for key in keys:
        print(
            f"  {key:<34} {meter.calls[key] / steps:6.2f} {meter.xacts[key] / steps:6.2f} "
            f"{meter.writes[key] / steps:6.2f} "
            f"{meter.statements[key] / steps:6.2f} {meter.checkouts[key] / steps:9.2f} "
            f"{1000 * meter.seconds[key] / steps:7.3f}"
        )
    xacts, pings = sum(meter.xacts.values()), sum(meter.checkouts.values())
    print(
        f"  {'total':<34} {'':6} {xacts / steps:6.2f} {sum(meter.writes.values()) / steps:6.2f} "
        f"{sum(meter.statements.values()) / steps:6.2f} {pings / steps:9.2f} "
        f"{1000 * total / steps:7.3f}"
    )
    print(
        "  (task rows include the store methods below them; a checkout pings the server "
        "only after 1 s idle)"
    )


def _profile(prof: cProfile.Profile, top: int) -> None:
    stats = pstats.Stats(prof)
    stats.strip_dirs()
    print("\n  cProfile, by own time:")
    stats.sort_stats("tottime").print_stats(top)
    print("  cProfile, by cumulative time:")
    stats.sort_stats("cumulative").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument(
        "--cprofile", action="store_true", help="also run cProfile (slows the Python parts)"
    )
    parser.add_argument("--top", type=int, default=25, help="cProfile rows to print")
    parser.add_argument(
        "--messages",
        action="store_true",
        help="one step per delivered message (a worker with FLEET_INLINE_STEPS=1)",
    )
    parser.add_argument(
        "--trips",
        action="store_true",
        help="count round trips to Postgres (libpq's trace: slows every statement)",
    )
    args = parser.parse_args()
    meter = Meter()
    with services("prof") as svc:
        client, sent = _client(svc.database_url)
        # The classes, not the instances: the commit's transaction runs through copies
        # bound to it (``Ledger.within``, ``Queries.within``).
        meter.wrap(type(client.runtime.ledger), "Ledger")
        meter.wrap(type(client.runtime.queries), "Queries")
        meter.listen()
        _meter_heartbeat(meter)
        wire = Wire()
        run = client.enqueue("seq", args.steps)
        inline = not args.messages
        _deliver(client, sent, meter, executes=args.steps // 2, inline=inline)  # warm-up
        client.runtime.db.dispose()
        db = database_name(svc)
        pg_before = settled_pg_counters(db)
        meter.reset()
        if args.trips:
            wire.start()
        prof = cProfile.Profile()
        machine = CpuMeter().start()
        t0, cpu0 = time.perf_counter(), time.process_time()
        if args.cprofile:
            prof.enable()
        tasks = _deliver(client, sent, meter, inline=inline)
        prof.disable()
        total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        machine.stop()
        trips = wire.stop() if args.trips else None
        assert run.status() == "succeeded", run.status()
        client.runtime.db.dispose()
        pg_used = delta(settled_pg_counters(db), pg_before)
    measured = tasks.pop("step")
    print(
        f"profile: steps {args.steps - measured + 1}-{args.steps} of one seq({args.steps}) run, "
        f"in process on Postgres, {'one step per message' if args.messages else 'inline'}: "
        f"{1000 * total / measured:.2f} ms/step, {1000 * cpu / measured:.2f} ms of this "
        f"process's CPU ({measured / total:.0f} steps/s without broker or Celery)"
    )
    shares = machine.per_unit_ms(measured)
    print(
        f"  CPU per step: the machine {shares['machine']:.2f} ms, Postgres "
        f"{shares.get('postgres', 0.0):.2f} ms (its backends, WAL writer and the rest, "
        "from /proc)"
    )
    print(f"  messages sent per step: { {k: round(v / measured, 3) for k, v in tasks.items()} }")
    server = pg_used.get("commits", 0) + pg_used.get("rollbacks", 0)
    print(
        f"  pg_stat_database: {server / measured:.2f} xacts/step "
        f"(commits {pg_used.get('commits', 0) / measured:.2f}, "
        f"rollbacks {pg_used.get('rollbacks', 0) / measured:.2f}; "
        f"the final status read adds one); cluster-wide write xacts/step "
        f"{pg_used.get('xid', 0) / measured:.2f} (others' writes count too)"
    )
    if trips is not None:
        print(f"  round trips to Postgres per step: {trips / measured:.2f} (libpq's trace)")
    _table(meter, measured, total)
    if args.cprofile:
        _profile(prof, args.top)


if __name__ == "__main__":
    main()
