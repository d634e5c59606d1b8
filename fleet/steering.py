"""``Fleet``'s steering methods (the ``Steering`` mixin): what a person does to a
run in flight. ``cancel`` it, ``signal`` its waits, ``resolve`` an effect in doubt,
``raise_budget`` when it parked on its spend, ``replay`` a dead-lettered step.

Each is what the CLI and the console call (invariant 13: they act only through these),
and each takes ``by`` (who acts) and ``why``: with ``by``, the action is recorded in
the audit (``fleet/store/audit.py``) in the transaction of the change it makes, and a
refused action (the run had ended, the step was not in doubt, the letter was replayed
already) records nothing. Bad input is ``BadInput`` in one line, before any change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleet.errors import BadInput, WaitNotOpen
from fleet.handle import RunHandle
from fleet.registry import check_budget, check_name
from fleet.states import StepKind, StepStatus
from fleet.store import audit
from fleet.worker.replay import step_shadow

if TYPE_CHECKING:
    from fleet.worker.runtime import Runtime

_UNSET: Any = object()


class Steering:
    """``Fleet``'s methods that steer a run: each changes it through the store's ledger,
    then wakes a worker through the dispatcher."""

    runtime: Runtime

    if TYPE_CHECKING:  # provided by Fleet

        def ensure_schema(self, create: bool = False) -> None: ...

        def run(self, run_id: str) -> RunHandle: ...

    def replay(
        self,
        dead_letter_id: int,
        input: Any = _UNSET,
        *,
        by: str | None = None,
        why: str | None = None,
    ) -> RunHandle:
        """Re-run a dead-lettered step with a fresh attempt budget (optionally with new
        ``input``: a list of arguments, or ``{"args": [...], "kwargs": {...}}``); its run
        resumes from that step. The dead letter is marked replayed, not deleted.
        With ``by`` (who acts) the replay is audited, ``why`` with it (as for ``cancel``)."""
        action = audit.action(
            by, why, "replay", f"dead letter {dead_letter_id}", edited_input=input is not _UNSET
        )
        self.ensure_schema()
        letter = self.runtime.queries.dead_letter(dead_letter_id)
        if letter is None:
            raise BadInput(f"unknown dead letter {dead_letter_id}")
        new_input = None
        if input is not _UNSET:
            call = input if isinstance(input, dict) else {"args": input, "kwargs": {}}
            if not isinstance(call.get("args", []), list) or not isinstance(
                call.get("kwargs", {}), dict
            ):
                raise BadInput(
                    "replay input must be a JSON list of arguments or "
                    '{"args": [...], "kwargs": {...}}'
                )
            new_input = self.runtime.payloads.dump(
                {"args": call.get("args", []), "kwargs": call.get("kwargs", {})},
                what=f"input of step {letter.step_id}",
            )
        refused = self.runtime.ledger.replay_dead_letter(dead_letter_id, new_input, action)
        if refused is not None:
            raise BadInput(f"dead letter {dead_letter_id} cannot be replayed: {refused}")
        run = self.runtime.queries.run(letter.run_id)
        assert run is not None
        self.runtime.dispatcher.execute(
            letter.run_id,
            letter.step_id,
            run.queue,
            shadow=step_shadow(run.workflow, letter.name),
        )
        return self.run(letter.run_id)

    def cancel(
        self,
        run_id: str,
        reason: str = "cancelled",
        *,
        by: str | None = None,
        why: str | None = None,
    ) -> bool:
        """Cancel a live run: no new step starts, a running step's lease is revoked (its
        commit is fenced), a waiting run stops waiting. Its live children are cancelled
        with it (not those started ``detached``); a child cancelled on its own fails its
        parent's ``wf.child`` with ``ChildFailed``. False if it had already ended.

        With ``by`` (who acts: ``cli:alice``, a console user) the action is recorded in
        the audit, with ``why``, in the transaction that makes it (invariant 13); the
        same for ``signal``, ``resolve``, ``raise_budget`` and ``replay``. A refused
        action records nothing."""
        action = audit.action(by, why, "cancel", reason=reason)
        row = self.run(run_id).row()
        if not self.runtime.ledger.cancel_run(run_id, reason, action):
            return False
        parent = row.parent_id and self.runtime.queries.run(row.parent_id)
        if parent:  # its child step is settled: the parent goes on
            self.runtime.dispatcher.advance(parent.id, parent.queue)
        return True

    def resolve(
        self,
        run_id: str,
        step_id: str,
        output: Any = _UNSET,
        retry: bool = False,
        *,
        by: str | None = None,
        why: str | None = None,
    ) -> None:
        """Settle an in-doubt effect of a run in ``needs_decision``: ``output=...`` says it
        happened and what it returned; ``retry=True`` orders it run again (same key).
        ``by``, ``why``: audited, as for ``cancel``."""
        if (output is _UNSET) == (not retry):
            raise BadInput("resolve takes either output=... or retry=True")
        outcome = "retry" if retry else "happened"
        action = audit.action(by, why, "resolve", step_id, outcome=outcome)
        row = self.run(run_id).row()
        text = None
        if output is not _UNSET:
            text = self.runtime.payloads.dump(output, what=f"output of step {step_id}")
        if not self.runtime.ledger.resolve(run_id, step_id, text, action):
            raise BadInput(
                f"step {step_id!r} of run {run_id} is not an effect in doubt (run is {row.status})"
            )
        if retry:
            step = self.runtime.queries.step(run_id, step_id)
            name = step_id if step is None else step.name
            self.runtime.dispatcher.execute(
                run_id, step_id, row.queue, shadow=step_shadow(row.workflow, name)
            )
        else:
            self.runtime.dispatcher.advance(run_id, row.queue)

    def raise_budget(
        self,
        run_id: str,
        tokens: int | None = None,
        cost: float | None = None,
        *,
        by: str | None = None,
        why: str | None = None,
    ) -> None:
        """Let a run parked on its budget go on, with the new limit(s). ``by``, ``why``:
        audited, as for ``cancel``."""
        new_tokens, new_cost = check_budget(
            {k: v for k, v in (("tokens", tokens), ("cost", cost)) if v is not None}
        )
        action = audit.action(by, why, "raise_budget", tokens=new_tokens, cost=new_cost)
        row = self.run(run_id).row()
        if not self.runtime.ledger.raise_budget(run_id, new_tokens, new_cost, action):
            raise BadInput(f"run {run_id} is {row.status}, not waiting on its budget")
        for step in self.runtime.queries.steps(run_id):
            if step.kind == StepKind.TASK and step.status == StepStatus.PENDING:
                self.runtime.dispatcher.execute(
                    run_id, step.step_id, row.queue, shadow=step_shadow(row.workflow, step.name)
                )

    def signal(
        self,
        run_id: str,
        name: str,
        payload: Any = None,
        *,
        wait_id: str | None = None,
        by: str | None = None,
        why: str | None = None,
    ) -> None:
        """Send ``payload`` to the run's ``wf.wait_for(name)``: now, or kept until it waits.
        Raises ``UnknownRun``, or ``BadInput`` if the run has ended. ``by``, ``why``:
        audited, as for ``cancel`` (the payload is the signal's, not the audit's).

        With ``wait_id`` (an id from ``RunHandle.waits()``) the signal answers that open
        wait and no other, in one conditional write: if it is no longer open (answered
        already, timed out, the run ended) ``WaitNotOpen`` is raised and nothing is
        recorded, so a decision sent twice can never be consumed by a later wait."""
        check_name(name, "signal")
        if wait_id is not None and not (isinstance(wait_id, str) and 0 < len(wait_id) <= 300):
            raise BadInput(f"wait_id={wait_id!r:.80} must be a wait's id from run.waits()")
        action = audit.action(by, why, "signal", name, wait=wait_id)
        row = self.run(run_id).row()
        text = self.runtime.payloads.dump(payload, what=f"payload of signal {name}")
        if wait_id is not None:
            if not self.runtime.ledger.answer_wait(run_id, wait_id, name, text, action):
                raise WaitNotOpen(
                    f"run {run_id} has no open wait {wait_id!r} on signal {name!r}: "
                    "it was answered, timed out or ended; nothing was sent"
                )
            self.runtime.dispatcher.advance(run_id, row.queue)
            return
        if self.runtime.ledger.add_signal(run_id, name, text, action) is None:
            status = (self.runtime.queries.run(run_id) or row).status
            raise BadInput(f"run {run_id} is {status}: a signal can only go to a live run")
        if self.runtime.ledger.deliver_signals(run_id):
            self.runtime.dispatcher.advance(run_id, row.queue)
