"""The effect gate: what runs before an effect step's body (invariant 5).

An effect's idempotency key is ``run_id:step_id``, the same on every attempt. Before the
body runs, an earlier attempt that may have acted (an intent with no outcome) is settled
first: by the step's reconcile hook if it has one, by retrying if it is declared
idempotent, and otherwise by parking the run for a person's decision, never by a guess.
Then this attempt writes its own intent, fenced by its epoch, and only then acts.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from fleet.states import IntentOutcome
from fleet.worker.context import Attempt, StepContext

log = logging.getLogger("fleet.attempt")


class Gate(Enum):
    RUN = "run the body"
    STOP = "do not run the body"


@dataclass(frozen=True)
class Reconciled:
    """The reconcile hook found the effect had happened: its output stands for the body's."""

    output: Any
    settles: IntentOutcome = IntentOutcome.RECONCILED


def effect_gate(att: Attempt, ctx: StepContext, call: Callable[..., Any]) -> Gate | Reconciled:
    """Before an effect's body runs: settle what earlier attempts may have done, then
    write this attempt's intent. Never retries an effect on a guess. ``call`` calls
    the reconcile hook (``aio.Runner``: an ``async def`` one runs on the process's loop)."""
    rt, sd, lease = att.rt, att.sd, att.lease
    run_id, step_id = lease.run_id, lease.step_id
    if rt.queries.in_doubt(run_id, step_id, before_epoch=lease.epoch):
        if sd.reconcile_fn is not None:
            found = call(sd.reconcile_fn, ctx)
            if found is not None:
                log.info("effect %s of run %s: reconcile found it happened", step_id, run_id)
                return Reconciled(found)
            log.info("effect %s of run %s: reconcile found it did not happen", step_id, run_id)
        elif not sd.idempotent:
            if rt.ledger.park_in_doubt(run_id, step_id, lease.epoch):
                log.warning(
                    "effect %s of run %s may have acted in an earlier attempt; the run needs "
                    "a decision: fleet resolve %s %s (--output JSON | --retry)",
                    step_id,
                    run_id,
                    run_id,
                    step_id,
                )
            return Gate.STOP
        if not rt.ledger.supersede_intents(run_id, step_id, lease.epoch):
            return Gate.STOP
    input_hash = hashlib.sha256(lease.input.encode()).hexdigest()
    if not rt.ledger.write_intent(run_id, step_id, lease.epoch, ctx.idempotency_key, input_hash):
        log.warning("effect %s of run %s lost its lease before acting", step_id, run_id)
        return Gate.STOP
    return Gate.RUN
