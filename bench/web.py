"""The async client in a web app (issue #20): 200 concurrent requests that each enqueue
an agent run, against ``uvicorn bench.web_app:app`` (``tasks/web.py`` with a loop probe)
on Postgres + Redis. For each repetition: the endpoint's latency (p50, p99, max) as
httpx sees it, and how late a 5 ms ticker on the app's loop woke meanwhile (p99, max):
``POST /runs-noop`` (no fleet call: the web stack alone), the async ``POST /runs``
(``aenqueue`` and ``astatus``: batched inserts, shared reads), ``POST /runs-per-call``
(the same two calls each alone on a pool of 4 threads, as before issue #20's batching),
then ``POST /runs-blocking`` (the sync ``enqueue`` called on the loop). No worker runs:
the runs stay queued. ``BENCH_OFF_LOOP_THREADS=N`` sizes the app's pool (default: the
library's), ``BENCH_PER_CALL_THREADS=N`` the one before (default 4).

    .venv/bin/python -m bench.web [--requests 200] [--reps 3]

A measurement, never a test: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import time
import uuid
from typing import Any

import httpx

from bench.common import percentile, save, services, spread
from fleet import Settings
from fleet.aio_client import OFF_LOOP_THREADS
from fleet.testing import FleetProcess
from tasks.app import fleet

LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
TARGET_LAG_MS = 20.0  # the issue's: the loop never late by more than this
REDIS_DB = 11  # not the other benchmarks' (12, 13, 7): they may run beside this one


async def burst(base: str, path: str, n: int) -> list[float]:
    """``n`` POSTs at once, each with its own key: their latencies in seconds."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:

        async def one() -> float:
            t0 = time.perf_counter()
            r = await http.post(path, headers={"Idempotency-Key": uuid.uuid4().hex})
            r.raise_for_status()
            return time.perf_counter() - t0

        await http.get("/lag")  # the connection pool warm, the probe cleared
        return list(await asyncio.gather(*[one() for _ in range(n)]))


def lags(base: str) -> list[float]:
    return [float(x) for x in httpx.get(base + "/lag", timeout=10).json()["late"]]


def measure(n: int, rep: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with services("web", redis_db=REDIS_DB) as svc:
        client = fleet.with_settings(Settings.from_env(svc.env()))
        client.upgrade_schema()
        client.runtime.db.dispose()
        server = FleetProcess(
            "web",
            ["bench.web_app:app", "--host", "127.0.0.1", "--port", "0", "--log-level", "info"],
            svc.env(),
            svc.workdir,
            module="uvicorn",
        )
        try:
            # Its address is logged after "Application startup complete": wait for it.
            if not server.wait_for_output("Uvicorn running on", 60):
                raise RuntimeError(f"uvicorn did not start:\n{server.output()[-3000:]}")
            found = LISTENING.search(server.output())
            if found is None:
                raise RuntimeError(f"no port in uvicorn's log:\n{server.output()[-3000:]}")
            base = f"http://127.0.0.1:{found.group(1)}"
            asyncio.run(burst(base, "/runs", 20))  # first calls: schema check, pools
            # A burst of each fleet call at full size first: the app's first bursts pay
            # one-off costs (its first full garbage collection: 0.1-0.2 s here) that would
            # land on whichever variant came first.
            for path in ("/runs", "/runs-per-call"):
                asyncio.run(burst(base, path, n))
            # The two async variants in turn first (rep by rep), the machine's load alike.
            pair = [("async", "/runs"), ("per_call", "/runs-per-call")][:: 1 - 2 * (rep % 2)]
            variants = [("noop", "/runs-noop"), *pair, ("blocking", "/runs-blocking")]
            for name, path in variants:
                lat = asyncio.run(burst(base, path, n))
                late = lags(base)
                out[f"{name}_p50_ms"] = 1000 * percentile(lat, 50)
                out[f"{name}_p99_ms"] = 1000 * percentile(lat, 99)
                out[f"{name}_max_ms"] = 1000 * max(lat)
                out[f"{name}_per_s"] = n / max(lat)
                out[f"{name}_lag_p99_ms"] = 1000 * percentile(late, 99) if late else float("nan")
                out[f"{name}_lag_max_ms"] = 1000 * max(late) if late else float("nan")
        finally:
            server.signal(9)
            server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    threads = int(os.environ.get("BENCH_OFF_LOOP_THREADS") or OFF_LOOP_THREADS)
    print(
        f"web: {args.requests} concurrent POSTs enqueueing agent runs, {args.reps} rep(s), "
        f"{threads} off-loop thread(s)"
    )
    reps: list[dict[str, Any]] = []
    for i in range(args.reps):
        reps.append(measure(args.requests, i))
        r = reps[-1]
        print(
            f"  rep {i + 1}: async p50 {r['async_p50_ms']:.0f} ms p99 {r['async_p99_ms']:.0f} ms, "
            f"loop late p99 {r['async_lag_p99_ms']:.1f} ms max {r['async_lag_max_ms']:.1f} ms | "
            f"per call p99 {r['per_call_p99_ms']:.0f} ms, loop late p99 "
            f"{r['per_call_lag_p99_ms']:.1f} ms | "
            f"blocking p99 {r['blocking_p99_ms']:.0f} ms, loop late max "
            f"{r['blocking_lag_max_ms']:.0f} ms",
            flush=True,
        )
    summary = {k: spread([r[k] for r in reps], "{:.1f}") for k in reps[0]}
    worst = statistics.median(r["async_lag_p99_ms"] for r in reps)
    verdict = "met" if worst < TARGET_LAG_MS else "MISSED"
    print(
        f"  async: endpoint p99 {summary['async_p99_ms']} ms; loop late p99 "
        f"{summary['async_lag_p99_ms']} ms (target < {TARGET_LAG_MS:.0f}: {verdict})"
    )
    for name in ("noop", "async", "per_call", "blocking"):
        print(
            f"  {name}: endpoint p99 {summary[f'{name}_p99_ms']} ms; loop late p99 "
            f"{summary[f'{name}_lag_p99_ms']} ms, max {summary[f'{name}_lag_max_ms']} ms"
        )
    params = {**vars(args), "threads": threads}
    path = save("web", {"params": params, "summary": summary, "reps": reps})
    print(f"  saved {path}")


if __name__ == "__main__":
    main()
