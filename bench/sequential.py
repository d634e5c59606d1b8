"""Benchmark 1 of issue #7, sequential overhead: one run of N no-op steps (500 by
default) on one worker, in steps per second from enqueue to the run's end, against

* raw Celery: a chain of N no-op tasks (``acks_late``, no result backend) on the same
  Redis and the same pool and concurrency, timed until its last task ran;
* DBOS Transact: one workflow of N no-op ``@DBOS.step()``s, its system database on the
  same Postgres (a fresh database), timed from ``start_workflow`` to its result.

For the fleet run it also counts, per step, the store's transactions (the bench
database's ``xact_commit + xact_rollback`` delta in ``pg_stat_database``, less this
script's own polls; write transactions from the cluster's transaction-id delta) and
the broker's messages (those the worker received, from its log; and from Redis
``INFO commandstats``: LPUSH, PUBLISH for Celery's task events, every command). Redis
and Postgres are shared: server-wide counts include others' traffic, measured in a quiet
second before each run and flagged when LPUSHes and received messages disagree.

    .venv/bin/python -m bench.sequential [--reps 3] [--steps 500]

A measurement, never a test: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from bench.common import (
    delta,
    others_active,
    pg_xacts_by_database,
    redis_calls,
    save,
    services,
    settled_pg_counters,
    spread,
    wait_until,
)
from bench.drivers import (
    POOLS,
    RECEIVED,
    RunClock,
    celery_app,
    celery_workers,
    database_name,
    dbos_seconds,
    fleet_client,
    fleet_workers,
    quiet_redis,
)

TARGETS = {"fleet/celery": 1.0, "fleet/DBOS": 2.0}
MAX_XACTS, MAX_MESSAGES = 2.0, 1.0


@dataclass
class FleetFigures:
    """One fleet run: its speed and what it cost the store and the broker, per step."""

    steps_per_s: float
    xacts_per_step: float
    write_xacts_per_step: float
    rows_inserted_per_step: float
    rows_updated_per_step: float
    messages_per_step: float
    pushes_per_step: float
    publishes_per_step: float
    redis_commands_per_step: float
    redis_background_per_s: float
    other_db_xacts: int


def _per_step(counts: dict[str, int], keys: tuple[str, ...], steps: int) -> float:
    return sum(counts.get(k, 0) for k in keys) / steps


def measure_fleet(steps: int, concurrency: int, pool: str) -> FleetFigures:
    """One ``seq(steps)`` run on one fleet worker."""
    with services("seq") as svc:
        client = fleet_client(svc)
        db = database_name(svc)
        pg_before, others_before = settled_pg_counters(db), pg_xacts_by_database()
        clock = RunClock(svc)
        with fleet_workers(svc, 1, concurrency, pool) as procs:
            background = quiet_redis()
            redis_before = redis_calls()
            run = client.enqueue("seq", steps)
            seconds = clock.wait([run.id], timeout=240)
            redis_used = delta(redis_calls(), redis_before)
            received = sum(p.output().count(RECEIVED) for p in procs)
        clock.close()
        client.runtime.db.dispose()
        pg_used = delta(settled_pg_counters(db), pg_before)
        others = others_active(others_before, pg_xacts_by_database(), db)
    xacts = pg_used.get("commits", 0) + pg_used.get("rollbacks", 0) - clock.polls
    return FleetFigures(
        steps_per_s=steps / seconds,
        xacts_per_step=xacts / steps,
        write_xacts_per_step=pg_used.get("xid", 0) / steps,
        rows_inserted_per_step=pg_used.get("inserted", 0) / steps,
        rows_updated_per_step=pg_used.get("updated", 0) / steps,
        # The enqueue's advance is the run's, not a step's: one message per run.
        messages_per_step=(received - 1) / steps,
        pushes_per_step=(_per_step(redis_used, ("lpush", "rpush"), 1) - 1) / steps,
        publishes_per_step=_per_step(redis_used, ("publish",), steps),
        redis_commands_per_step=(sum(redis_used.values()) - 1) / steps,
        redis_background_per_s=background,
        other_db_xacts=others,
    )


def measure_celery(steps: int, concurrency: int, pool: str) -> tuple[float, float]:
    """A raw Celery chain of ``steps`` no-op tasks on one worker: (steps/s, Redis
    commands per step)."""
    from celery import chain

    with services("seqraw") as svc:
        app = celery_app(svc)
        noop = app.tasks["raw.noop"]
        mark = f"bench:mark:{uuid.uuid4().hex}"
        redis = svc.redis()
        polls = 0

        def marked() -> Any:
            nonlocal polls
            polls += 1
            return redis.get(mark)

        with celery_workers(svc, 1, concurrency, pool):
            redis_before = redis_calls()
            started = time.time()
            chain(*[noop.si(i) for i in range(steps - 1)], noop.si(steps - 1, mark=mark)).delay()
            ended = float(wait_until(marked, 240, "the chain's last task"))
            redis_used = delta(redis_calls(), redis_before)
    # Our INFO and our polls are not the chain's.
    return steps / (ended - started), (sum(redis_used.values()) - 1 - polls) / steps


def measure_dbos(steps: int) -> float:
    """One DBOS workflow of ``steps`` no-op steps: steps/s."""
    with services("seqdbos") as svc:
        return steps / dbos_seconds(svc, steps)


def one_rep(steps: int, concurrency: int, pool: str) -> dict[str, Any]:
    fleet = measure_fleet(steps, concurrency, pool)
    celery, celery_redis = measure_celery(steps, concurrency, pool)
    dbos = measure_dbos(steps)
    return {
        "fleet": asdict(fleet),
        "celery_steps_per_s": celery,
        "celery_redis_commands_per_step": celery_redis,
        "dbos_steps_per_s": dbos,
        "fleet/celery": fleet.steps_per_s / celery,
        "fleet/DBOS": fleet.steps_per_s / dbos,
    }


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _busy(fleet: dict[str, Any]) -> bool:
    """Others used the shared Redis or Postgres during the fleet run: server-wide counts
    (LPUSHes beyond the messages the worker received, other databases' transactions)
    include their traffic."""
    return (
        abs(fleet["pushes_per_step"] - fleet["messages_per_step"]) > 0.005
        or fleet["other_db_xacts"] > 0
    )


def report(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the table (targets judged on the median); return the medians and ranges
    that are saved."""
    fleet = [r["fleet"] for r in reps]
    col = {k: [f[k] for f in fleet] for k in fleet[0]}
    rows: list[tuple[str, str, str]] = [
        ("fleet steps/s", spread(col["steps_per_s"]), ""),
        ("raw Celery chain steps/s", spread([r["celery_steps_per_s"] for r in reps]), ""),
        ("DBOS steps/s", spread([r["dbos_steps_per_s"] for r in reps]), ""),
    ]
    for name, target in TARGETS.items():
        values = [r[name] for r in reps]
        ok = statistics.median(values) >= target
        rows.append((name, spread(values, "{:.2f}"), f"target >= {target}: {_verdict(ok)}"))
    xacts, messages = col["xacts_per_step"], col["messages_per_step"]
    rows += [
        (
            "fleet store xacts/step",
            spread(xacts, "{:.2f}"),
            f"target <= {MAX_XACTS:g}: {_verdict(statistics.median(xacts) <= MAX_XACTS)}",
        ),
        ("  write xacts/step (cluster-wide)", spread(col["write_xacts_per_step"], "{:.2f}"), ""),
        ("  rows inserted/step", spread(col["rows_inserted_per_step"], "{:.2f}"), ""),
        ("  rows updated/step", spread(col["rows_updated_per_step"], "{:.2f}"), ""),
        (
            "fleet broker messages/step (+1/run)",
            spread(messages, "{:.2f}"),
            f"target <= {MAX_MESSAGES:g}: {_verdict(statistics.median(messages) <= MAX_MESSAGES)}",
        ),
        ("  LPUSH/step (Redis-wide)", spread(col["pushes_per_step"], "{:.2f}"), ""),
        ("  PUBLISH (task events)/step", spread(col["publishes_per_step"], "{:.2f}"), ""),
        ("  all Redis commands/step", spread(col["redis_commands_per_step"], "{:.1f}"), ""),
        (
            "  raw Celery Redis commands/step",
            spread([r["celery_redis_commands_per_step"] for r in reps]),
            "",
        ),
        ("Redis background cmds/s", spread(col["redis_background_per_s"]), "others' traffic"),
        (
            "other DBs' xacts in window",
            spread([float(v) for v in col["other_db_xacts"]], "{:.0f}"),
            "others' load (dropped DBs unseen)",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:<34} {note}")
    return {k: spread(v, "{:.3f}") for k, v in col.items()} | {
        name: spread([r[name] for r in reps], "{:.3f}") for name in TARGETS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--pool", choices=POOLS, default="threads")
    args = parser.parse_args()
    print(
        f"sequential overhead: 1 run x {args.steps} no-op steps, 1 worker "
        f"(--pool {args.pool} --concurrency {args.concurrency}), {args.reps} rep(s)"
    )
    reps = []
    for i in range(args.reps):
        reps.append(one_rep(args.steps, args.concurrency, args.pool))
        r = reps[-1]
        print(
            f"  rep {i + 1}: fleet {r['fleet']['steps_per_s']:.0f}, "
            f"celery {r['celery_steps_per_s']:.0f}, DBOS {r['dbos_steps_per_s']:.0f} steps/s; "
            f"fleet {r['fleet']['xacts_per_step']:.2f} xacts, "
            f"{r['fleet']['messages_per_step']:.2f} messages per step"
            + (" (shared services busy: counts include others')" if _busy(r["fleet"]) else ""),
            flush=True,
        )
    summary = report(reps)
    path = save(
        "sequential",
        {"params": vars(args), "targets": TARGETS, "summary": summary, "reps": reps},
    )
    print(f"  saved {path}")


if __name__ == "__main__":
    main()
