"""Records kept outside the store, for tests to check the store against: the step
execution log, and a stand-in provider for effect steps that records every call by
idempotency key in the file named by FLEET_TEST_PROVIDER and applies the first one per
key, as a real mail or payment API with idempotency keys does."""

from __future__ import annotations

import json
import os
import time
from typing import Any


def append_event(variable: str, ctx: Any, event: str, **extra: Any) -> None:
    """Append one line about a step execution (run, step, epoch, attempt, pid, time,
    event) to the file named by the environment ``variable``, if it is set."""
    path = os.environ.get(variable)
    if not path:
        return
    line = json.dumps(
        {
            "run": ctx.run_id,
            "step": ctx.step_id,
            "epoch": ctx.epoch,
            "attempt": ctx.attempt,
            "pid": os.getpid(),
            "t": time.time(),
            "event": event,
            **extra,
        }
    )
    # O_APPEND writes of one short line are atomic across processes.
    with open(path, "a") as f:
        f.write(line + "\n")


def _provider_path() -> str:
    return os.environ.get("FLEET_TEST_PROVIDER", "provider.jsonl")


def provider_calls(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def provider_apply(key: str, body: str) -> dict[str, Any]:
    import fcntl

    with open(_provider_path(), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        earlier = [json.loads(line) for line in f if line.strip()]
        applied = next((c for c in earlier if c["key"] == key and c["applied"]), None)
        f.write(json.dumps({"key": key, "body": body, "applied": applied is None}) + "\n")
    return {"receipt": key, "body": applied["body"] if applied else body}


def provider_lookup(key: str) -> dict[str, Any] | None:
    applied = next(
        (c for c in provider_calls(_provider_path()) if c["key"] == key and c["applied"]), None
    )
    return None if applied is None else {"receipt": key, "body": applied["body"]}
