"""A notifier workflow: plan a topic, then deliver the plan through an effect step.

The "outbox" is a JSON-lines file (``FLEET_OUTBOX``, default ``.fleet/outbox.jsonl``)
standing in for a mail service that deduplicates on the idempotency key.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from fleet import StepContext, WorkflowContext
from tasks.app import fleet
from tasks.research import llm_plan

DEFAULT_OUTBOX = ".fleet/outbox.jsonl"


def outbox_path() -> Path:
    """The outbox file named by ``FLEET_OUTBOX``."""
    return Path(os.environ.get("FLEET_OUTBOX") or DEFAULT_OUTBOX)


def read_outbox(path: Path | None = None) -> list[dict[str, Any]]:
    """Every message delivered so far, oldest first."""
    path = path or outbox_path()
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def deliver(key: str, to: str, body: str, path: Path | None = None) -> bool:
    """Append one message unless ``key`` was delivered already; True if it was written.

    An exclusive file lock makes check-and-append one step, so two attempts of the same
    step (a zombie and its successor) cannot both write."""
    path = path or outbox_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        for line in f:
            if line.strip() and json.loads(line).get("key") == key:
                return False
        f.write(json.dumps({"key": key, "to": to, "body": body}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


@fleet.step(effect=True, idempotent=True)
def send_notification(ctx: StepContext, to: str, body: str) -> dict[str, Any]:
    """Deliver ``body`` to ``to`` once per idempotency key."""
    deliver(ctx.idempotency_key, to, body)
    return {"delivered": True, "key": ctx.idempotency_key}


@fleet.workflow(version="1")
def notify(wf: WorkflowContext, to: str, topic: str) -> dict[str, Any]:
    """Plan ``topic`` (one model step), then send the plan to ``to``."""
    plan = wf.step(llm_plan, topic)
    body = f"Research plan for {topic}:\n" + "\n".join(f"- {q}" for q in plan["subquestions"])
    receipt = wf.step(send_notification, to, body)
    return {"to": to, "topic": topic, **receipt}
