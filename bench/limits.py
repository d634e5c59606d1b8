"""The limits benchmark of issue #18: a fleet of agents under a provider's limits.

A stand-in provider (``bench/provider.py``, its own process) enforces 300 requests and
60,000 tokens per sliding minute and answers 429 with ``Retry-After`` over either. 40
runs of ``bench.limits_app.agent`` (20 model calls one after another, 120-300 tokens
each) run on 2 fleet worker processes x 8 threads (Postgres store, Redis broker): 38 of
tenant ``big`` enqueued first, then 2 of tenant ``small``. Then, on fresh services, the 2
``small`` runs alone. Each phase has its own database, Redis database, provider and
workers, so neither inherits the other's window.

* ``--limits off``: today. A 429 raises ``Retry(delay=Retry-After)``; every worker
  learns of the limit only from its own 429s.
* ``--limits on``: the step names ``fleet.limit("provider", requests_per_minute=300,
  tokens_per_minute=60_000)`` (reserving its ``max_tokens``, reporting its usage) and,
  with ``--per-tenant N``, ``fleet.limit("per-tenant", concurrency=N, per_tenant=True)``;
  a 429 raises ``Retry(delay, limit="provider")``.

Figures (all from the provider's records and the store; nothing asserts on time):

* **429s**: the share of the provider's requests it answered 429;
* **throughput**: per full minute from the first accepted request, the larger of
  requests / 300 and tokens / 60,000 (what binds); the mean over those minutes;
* **slots held by throttled steps**: a step holds a worker slot exactly while its attempt
  runs (the store's ``fleet_attempts`` start and end). Attempts whose request got a 429
  are the throttled ones: their slot-seconds, their peak at once and their mean over the
  busy period. A step the limits' gate defers holds no lease and makes no attempt; the
  workers' logs count those deferrals (each a delivery that returns at once);
* **fair share**: the time from the first ``small`` run's enqueue to the last one's end,
  over the same with ``big`` absent (target <= 1.5).

    .venv/bin/python -m bench.limits --limits off
    .venv/bin/python -m bench.limits --limits on --per-tenant 4
    # development: a 10 s window, the limits scaled with it, a smaller workload
    .venv/bin/python -m bench.limits --limits on --window 10 --rpm 50 --tpm 10000 \\
        --big 8 --small 2 --calls 10

Redis DB 7 only. Written to ``bench/out/limits_<off|on>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx

from bench import provider
from bench.common import Services, processes, save, services, wait_until
from bench.drivers import fleet_client, fleet_workers
from bench.io_bound import cpu_seconds, query

REDIS_DB = 7
APP = "bench.limits_app"
WORKERS, THREADS = 2, 8
DEFERRED = "waits on limit"  # what the gate logs when it sends a step back to wait


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def stand_in(svc: Services, args: argparse.Namespace) -> Iterator[str]:
    """The provider in its own process; its base URL."""
    port = free_port()
    argv = ["--port", str(port), "--rpm", str(args.rpm), "--tpm", str(args.tpm)]
    argv += ["--window", str(args.window)]
    with processes(svc, [("provider", argv)], provider.READY, module="bench.provider"):
        yield f"http://127.0.0.1:{port}"


def app_env(args: argparse.Namespace) -> dict[str, str]:
    """What ``bench.limits_app`` reads, for the workers and this process alike."""
    env = {
        "BENCH_LIMITS": args.limits,
        "BENCH_RPM": str(args.rpm),
        "BENCH_TPM": str(args.tpm),
        "BENCH_PER_TENANT": str(args.per_tenant if args.limits == "on" else 0),
    }
    if args.window != 60:
        env["BENCH_LIMIT_WINDOW"] = str(args.window)
    return env


def phase(args: argparse.Namespace, tenants: dict[str, int]) -> dict[str, Any]:
    """Fresh services, provider and workers; one warm-up run, then ``tenants``' runs
    (in that order) enqueued at once and waited for: the raw material of the figures."""
    from bench import limits_app

    label = "_".join(f"{t}{n}" for t, n in tenants.items())
    with services(f"limits_{args.limits}_{label}", redis_db=REDIS_DB) as svc:
        with stand_in(svc, args) as url:
            env = {**app_env(args), "BENCH_PROVIDER_URL": url}
            client = fleet_client(svc, limits_app.fleet, **env)
            with fleet_workers(svc, WORKERS, THREADS, "threads", APP, **env) as procs:
                warm = [client.enqueue("agent", 1, "warmup").id]
                wait_until(lambda: ended(client, warm), 60, "the warm-up run", 0.2)
                ids: dict[str, list[str]] = {}
                for tenant, n in tenants.items():
                    if tenant == "small" and ids and args.small_after:
                        time.sleep(args.small_after)  # enqueued into a busy provider
                    ids[tenant] = [
                        client.enqueue("agent", args.calls, tenant, tenant=tenant).id
                        for _ in range(n)
                    ]
                every = [i for group in ids.values() for i in group]
                timeout = args.calls * sum(tenants.values()) * 60 / args.rpm * 3 + 120
                wait_until(lambda: ended(client, every), timeout, "the runs to end", 0.5)
                deferrals = sum(p.output().count(DEFERRED) for p in procs)
                worker_cpu = sum(cpu_seconds(p.pid) for p in procs)
            seen = httpx.get(f"{url}/records", timeout=30).json()
        runs = query(
            client,
            "SELECT id, tenant, status, created_at, finished_at FROM fleet_runs"
            " WHERE id = ANY(:ids)",
            ids=every,
        )
        attempts = query(
            client,
            "SELECT run_id, step_id, epoch, outcome, error, started_at, finished_at"
            " FROM fleet_attempts WHERE run_id = ANY(:ids)",
            ids=every,
        )
        client.runtime.db.dispose()
    return {
        "tenants": tenants,
        "provider": seen,
        "runs": [dict(r._mapping) for r in runs],
        "attempts": [dict(a._mapping) for a in attempts],
        "deferrals": deferrals,
        "worker_cpu_s": worker_cpu,
    }


def ended(client: Any, ids: list[str]) -> bool:
    (row,) = query(
        client,
        "SELECT count(*) FROM fleet_runs WHERE id = ANY(:ids) AND finished_at IS NOT NULL",
        ids=ids,
    )
    return int(row[0]) == len(ids)


def span(runs: list[dict[str, Any]], tenant: str) -> float:
    """From the tenant's first run created to its last one finished (the store's clock)."""
    mine = [r for r in runs if r["tenant"] == tenant]
    return max(r["finished_at"] for r in mine) - min(r["created_at"] for r in mine)


def minutes(accepted: list[dict[str, Any]], rpm: int, tpm: int, window: float) -> list[float]:
    """Per full window from the first accepted request: max(requests/rpm, tokens/tpm)."""
    t0, last = accepted[0]["at"], accepted[-1]["at"]
    full = math.floor((last - t0) / window)
    out = []
    for k in range(full):
        inside = [r for r in accepted if t0 + k * window <= r["at"] < t0 + (k + 1) * window]
        out.append(max(len(inside) / rpm, sum(r["tokens"] for r in inside) / tpm))
    return out


def peak(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one moment."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    most = cur = 0
    for _, step in edges:
        cur += step
        most = max(most, cur)
    return most


def figures(mix: dict[str, Any], alone: dict[str, Any], window: float) -> dict[str, Any]:
    """The benchmark's figures from the two phases' records."""
    p = mix["provider"]
    reqs = sorted((r for r in p["records"] if r.get("tenant") != "warmup"), key=lambda r: r["at"])
    accepted = [r for r in reqs if r["ok"]]
    refused = len(reqs) - len(accepted)
    busy = accepted[-1]["at"] - accepted[0]["at"] if len(accepted) > 1 else float("nan")
    mins = minutes(accepted, p["rpm"], p["tpm"], window) if accepted else []
    throttled = {(r["run"], r["step"], r["epoch"]) for r in reqs if not r["ok"]}
    slots = [
        (a["started_at"], a["finished_at"])
        for a in mix["attempts"]
        if (a["run_id"], a["step_id"], a["epoch"]) in throttled and a["finished_at"]
    ]
    all_slots = [(a["started_at"], a["finished_at"]) for a in mix["attempts"] if a["finished_at"]]
    held = sum(b - a for a, b in slots)
    small_mix, small_alone = span(mix["runs"], "small"), span(alone["runs"], "small")
    return {
        "requests": len(reqs),
        "accepted": len(accepted),
        "refused_429": refused,
        "pct_429": 100 * refused / len(reqs) if reqs else float("nan"),
        "busy_s": busy,
        "accepted_per_min": len(accepted) / busy * 60 if busy else float("nan"),
        "tokens_per_min": sum(r["tokens"] for r in accepted) / busy * 60 if busy else 0,
        "full_minutes_of_limit": mins,
        "throughput_ratio": sum(mins) / len(mins) if mins else float("nan"),
        "provider_max_in_flight": p["max_in_flight"],
        "attempts": len(mix["attempts"]),
        "throttled_attempts": len(slots),
        "throttled_slot_s": held,
        "throttled_slots_peak": peak(slots),
        "throttled_slots_mean": held / busy if busy else float("nan"),
        "busy_slots_mean": sum(b - a for a, b in all_slots) / busy if busy else float("nan"),
        "gate_deferrals": mix["deferrals"],
        "worker_cpu_s": mix.get("worker_cpu_s", float("nan")),
        "runs_not_succeeded": sum(r["status"] != "succeeded" for r in mix["runs"]),
        "all_runs_s": max(r["finished_at"] for r in mix["runs"])
        - min(r["created_at"] for r in mix["runs"]),
        "small_with_big_s": small_mix,
        "small_alone_s": small_alone,
        "fair_share_ratio": small_mix / small_alone,
    }


def report(f: dict[str, Any], args: argparse.Namespace) -> None:
    w = f"{args.window:g} s"
    rows = [
        ("requests (accepted / 429)", f"{f['requests']} ({f['accepted']} / {f['refused_429']})"),
        ("429s", f"{f['pct_429']:.1f} %  (target <= 1 %)"),
        ("busy period", f"{f['busy_s']:.1f} s, {f['accepted_per_min']:.0f} accepted/min"),
        (
            f"of the limit per full {w}",
            ", ".join(f"{m:.2f}" for m in f["full_minutes_of_limit"])
            + f"  mean {f['throughput_ratio']:.2f} (target >= 0.9)",
        ),
        (
            "slots held by throttled steps",
            f"{f['throttled_attempts']} attempts, {f['throttled_slot_s']:.1f} slot-s, "
            f"peak {f['throttled_slots_peak']}, mean {f['throttled_slots_mean']:.2f} "
            f"of {WORKERS * THREADS} (target 0)",
        ),
        ("slots busy (any attempt), mean", f"{f['busy_slots_mean']:.2f}"),
        ("gate deferrals (no slot held)", str(f["gate_deferrals"])),
        ("workers' CPU (both processes)", f"{f['worker_cpu_s']:.1f} s"),
        ("provider's most in flight", str(f["provider_max_in_flight"])),
        ("runs not succeeded", str(f["runs_not_succeeded"])),
        ("all runs, enqueue to end", f"{f['all_runs_s']:.1f} s"),
        (
            "small tenant: with big / alone",
            f"{f['small_with_big_s']:.1f} s / {f['small_alone_s']:.1f} s = "
            f"{f['fair_share_ratio']:.2f}x (target <= 1.5)",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\nlimits {args.limits}: {args.big}+{args.small} runs x {args.calls} calls")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limits", choices=("off", "on"), required=True)
    p.add_argument("--per-tenant", type=int, default=0, help="with --limits on: concurrency")
    p.add_argument("--big", type=int, default=38, help="runs of tenant big")
    p.add_argument("--small", type=int, default=2, help="runs of tenant small")
    p.add_argument(
        "--small-after", type=float, default=0.0, help="seconds after big to enqueue small"
    )
    p.add_argument("--calls", type=int, default=20, help="model calls per run")
    p.add_argument("--rpm", type=int, default=300, help="provider: requests per window")
    p.add_argument("--tpm", type=int, default=60_000, help="provider: tokens per window")
    p.add_argument("--window", type=float, default=60.0, help="provider's window, seconds")
    p.add_argument("--out", default="", help="suffix of the JSON's name (dev runs)")
    return p.parse_args()


def main() -> None:
    args = parse()
    os.environ.update(app_env(args))  # read by bench.limits_app when phase imports it
    load = os.getloadavg()
    print(f"limits {args.limits}: {args.big} big + {args.small} small runs...", flush=True)
    mix = phase(args, {"big": args.big, "small": args.small})
    print("the small tenant alone...", flush=True)
    alone = phase(args, {"small": args.small})
    f = figures(mix, alone, args.window)
    report(f, args)
    path = save(
        f"limits_{args.limits}{args.out}",
        {
            "params": vars(args),
            "loadavg_before": load,
            "loadavg_after": os.getloadavg(),
            "figures": f,
            "raw": {"mix": mix, "alone": alone},
        },
    )
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
