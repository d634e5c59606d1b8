"""The workflows the limits benchmark (issue #18) runs: an agent that makes ``calls``
model calls one after another, each a step POSTing to the stand-in provider
(``bench/provider.py``) with httpx.

Workers load it as ``python -m fleet worker -A bench.limits_app``; the benchmark gives
every process the same environment:

* ``BENCH_PROVIDER_URL``: the stand-in's base URL;
* ``BENCH_LIMITS``: ``off`` (today: a 429 raises ``Retry(delay=Retry-After)``, each
  worker on its own) or ``on`` (the step names ``fleet.limit("provider", ...)`` with the
  provider's limits, reserves its ``max_tokens``, reports its usage, and a 429 raises
  ``Retry(delay, limit="provider")``, pausing the limit fleet-wide);
* ``BENCH_RPM`` / ``BENCH_TPM``: the provider's limits (300 and 60,000);
  ``BENCH_PER_TENANT``: with limits on, each tenant's running calls are capped at this
  many (``fleet.limit("per-tenant", concurrency=N, per_tenant=True)``; 0: no such limit);
* ``BENCH_LIMIT_WINDOW``: development only, a window shorter than the minute for the
  fleet's limiter too, to match a provider started with a scaled ``--window``.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from fleet import Fleet, RetryPolicy, Settings, StepContext, WorkflowContext
from fleet.errors import Retry

LIMITS_ON = os.environ.get("BENCH_LIMITS", "off") == "on"
RPM = int(os.environ.get("BENCH_RPM", "300"))
TPM = int(os.environ.get("BENCH_TPM", "60000"))
PER_TENANT = int(os.environ.get("BENCH_PER_TENANT", "0"))
PROVIDER = os.environ.get("BENCH_PROVIDER_URL", "http://127.0.0.1:8765")

if os.environ.get("BENCH_LIMIT_WINDOW"):  # a scaled window for a development run
    from fleet.worker import limiter as _redis_limiter

    if not hasattr(_redis_limiter, "WINDOW"):
        raise RuntimeError("BENCH_LIMIT_WINDOW: fleet.worker.limiter has no WINDOW to scale")
    _redis_limiter.WINDOW = float(os.environ["BENCH_LIMIT_WINDOW"])

fleet = Fleet("benchlimits")
celery_app = fleet.celery

# Every 429 is an attempt against the step's durable cap, so the cap is set far above
# what a throttled run meets; a step dead-lettered here shows in the figures.
PATIENT = RetryPolicy(max_attempts=200, initial_delay=0.5, max_delay=5.0)
LIMITS: list[str] = []
if LIMITS_ON:
    if PER_TENANT:
        fleet.limit("per-tenant", concurrency=PER_TENANT, per_tenant=True)
        LIMITS.append("per-tenant")
    fleet.limit("provider", requests_per_minute=RPM, tokens_per_minute=TPM)
    LIMITS.append("provider")

_http = httpx.Client(timeout=30.0, limits=httpx.Limits(max_connections=64))


def bind(env: dict[str, str]) -> Fleet:
    """This module's workflows bound to the store and broker named in ``env``."""
    return fleet.with_settings(Settings.from_env(env))


def tokens_of(i: int) -> int:
    """The tokens call ``i`` of a run asks for: 120-300, 210 on average, so that at the
    provider's 300 requests a minute its 60,000 tokens are what binds (285 calls)."""
    return 120 + 20 * (i % 10)


def _retry_after(resp: httpx.Response) -> float:
    """The provider's wait: ``retry-after-ms`` if given, else ``Retry-After`` seconds."""
    ms = resp.headers.get("retry-after-ms")
    if ms is not None:
        return float(ms) / 1000
    return float(resp.headers.get("retry-after", "1"))


@fleet.step(
    retry=PATIENT,
    limits=LIMITS,
    tokens=(lambda i, tokens, tenant: tokens) if LIMITS_ON else None,
)
def model_call(ctx: StepContext, i: int, tokens: int, tenant: str) -> int:
    """One model call of ``tokens`` tokens; a 429 asks for a retry after Retry-After."""
    resp = _http.post(
        f"{PROVIDER}/v1/chat/completions",
        json={
            "model": "stand-in",
            "messages": [{"role": "user", "content": f"call {i}"}],
            "max_tokens": tokens,
            "metadata": {
                "run": ctx.run_id,
                "step": ctx.step_id,
                "epoch": ctx.epoch,
                "attempt": ctx.attempt,
                "tenant": tenant,
            },
        },
    )
    if resp.status_code == 429:
        raise Retry(
            delay=_retry_after(resp),
            reason="429 from the provider",
            limit="provider" if LIMITS_ON else None,
        )
    resp.raise_for_status()
    usage: dict[str, Any] = resp.json()["usage"]
    ctx.record_usage(
        "stand-in", input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"]
    )
    return int(usage["total_tokens"])


@fleet.workflow
def agent(wf: WorkflowContext, calls: int, tenant: str) -> int:
    """An agent loop: ``calls`` model calls one after another; the tokens it used."""
    return sum(wf.step(model_call, i, tokens_of(i), tenant) for i in range(calls))
