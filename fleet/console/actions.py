"""The console's actions: ``POST /actions/<verb>``, each through the same ``Fleet`` method
as the CLI, with ``by=`` the signed-in user and ``why=`` what they wrote, so the store
records who did it and why in the transaction of the change.

The flow: the CSRF token is checked first (a stale or foreign form: 403, nothing
read or changed); then the input is checked and the target looked up (``prepare_*``:
unknown run 404, bad JSON 400, a run no longer in that state 409, one line each);
without ``confirm=yes`` the answer is a confirmation page repeating the fields;
with it the action is done and the browser is sent (303) to the run's page (or the
list) with what was done in ``#flash``. A refusal by ``Fleet`` itself (the run moved
on between the two clicks) is the same one-line page, with nothing changed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from fleet import codec
from fleet.bounds import whole
from fleet.console.letters import find, from_recorded, unchanged
from fleet.console.pages import positive
from fleet.console.render import Console, Refused, flash_query, no_nul, page, path, root
from fleet.errors import BadInput, PayloadError, WaitNotOpen
from fleet.registry import check_name
from fleet.states import Decision, RunStatus, StepStatus

log = logging.getLogger("fleet.console")

# Form fields that are not the action's own: never repeated as hidden inputs.
CONTROL = ("csrf", "confirm", "why")
MAX_RATE = 100.0
MIN_RATE = 0.01  # one every 100 s: slower, and the last of 1,000 letters waits a day


@dataclass(frozen=True)
class Plan:
    """A checked action: the question the confirmation asks, what doing it is (given
    ``why``, it returns the flash line), and where the browser goes afterwards."""

    question: str
    act: Callable[[str], str]
    back: str


Form = dict[str, str]
Prepare = Callable[[Console, Form, str], Plan]


def _json(text: str, what: str) -> Any:
    """A JSON value from a form field; empty is null. Not JSON, nested past
    ``bounds.MAX_DEPTH`` or holding a number of thousands of digits: 400."""
    if not text.strip():
        return None
    try:
        return codec.parse_json_arg(text, what=what)
    except PayloadError as exc:
        raise Refused(400, str(exc)) from None


def _run(c: Console, run_id: str) -> Any:
    if not run_id:
        raise Refused(400, "no run id given")
    run = c.fleet.runtime.queries.run(run_id)
    if run is None:
        raise Refused(404, f"unknown run '{run_id}'")
    return run


def _back(run_id: str) -> str:
    return f"/runs/{path(run_id)}"


def prepare_cancel(c: Console, form: Form, user: str) -> Plan:
    run_id = form.get("run_id", "")
    run = _run(c, run_id)
    if RunStatus(run.status).finished:
        raise Refused(409, f"run {run_id} has already ended ({run.status}): nothing to cancel")

    def act(why: str) -> str:
        reason = why or "cancelled from the console"
        if not c.fleet.cancel(run_id, reason=reason, by=user, why=why):
            raise Refused(409, f"run {run_id} had already ended: nothing was cancelled")
        return f"cancelled run {run_id}"

    return Plan(f"Cancel run {run_id}?", act, _back(run_id))


def prepare_signal(c: Console, form: Form, user: str) -> Plan:
    run_id, name = form.get("run_id", ""), form.get("name", "")
    check_name(name, "signal")
    data = _json(form.get("data", ""), "data")
    run = _run(c, run_id)
    if RunStatus(run.status).finished:
        raise Refused(409, f"run {run_id} is {run.status}: a signal can only go to a live run")

    def act(why: str) -> str:
        c.fleet.signal(run_id, name, data, by=user, why=why)
        return f"sent signal {name!r} to run {run_id}"

    return Plan(f"Send signal {name!r} to run {run_id}?", act, _back(run_id))


def prepare_decide(c: Console, form: Form, user: str) -> Plan:
    """An approval answers the one wait its form names (``wait_id``): the check and the
    signal are one conditional write (``Fleet.signal(..., wait_id=)``), so a second
    confirmation of the same decision is refused (409) with nothing written, and can
    never be consumed by the run's next wait (invariant 14)."""
    run_id, name = form.get("run_id", ""), form.get("name", "")
    wait_id = form.get("wait_id", "")
    decision, comment = form.get("decision", ""), form.get("comment", "")
    if decision not in ("approve", "reject"):
        raise Refused(400, f"decision must be approve or reject, got {decision!r}")
    check_name(name, "signal")
    if not wait_id:
        raise Refused(400, "this form names no wait: reload the page and decide again")
    run = _run(c, run_id)
    if not any(w.id == wait_id and w.name == name for w in c.fleet.run(run_id).waits()):
        raise Refused(
            409, f"run {run_id} has no open wait {wait_id!r} on {name!r} (it is {run.status})"
        )
    payload = {"approved": decision == "approve", "by": user, "comment": comment}

    def act(why: str) -> str:
        try:
            c.fleet.signal(run_id, name, payload, wait_id=wait_id, by=user, why=comment or why)
        except WaitNotOpen:
            raise Refused(
                409,
                f"wait {wait_id!r} of run {run_id} was already answered or is closed: "
                "nothing was sent",
            ) from None
        return f"{'approved' if decision == 'approve' else 'rejected'} run {run_id}"

    verb = "Approve" if decision == "approve" else "Reject"
    return Plan(f"{verb} run {run_id} (its wait {name!r})?", act, _back(run_id))


def prepare_resolve(c: Console, form: Form, user: str) -> Plan:
    run_id, step_id = form.get("run_id", ""), form.get("step_id", "")
    outcome = form.get("outcome", "")
    if outcome not in ("happened", "retry"):
        raise Refused(400, f"outcome must be happened or retry, got {outcome!r}")
    output = _json(form.get("output", ""), "output") if outcome == "happened" else None
    run = _run(c, run_id)
    step = c.fleet.runtime.queries.step(run_id, step_id)
    if step is None or step.status != StepStatus.IN_DOUBT:
        raise Refused(
            409, f"step {step_id!r} of run {run_id} is not an effect in doubt (run is {run.status})"
        )

    def act(why: str) -> str:
        if outcome == "retry":
            c.fleet.resolve(run_id, step_id, retry=True, by=user, why=why)
            return f"step {step_id} of run {run_id} will be run again"
        c.fleet.resolve(run_id, step_id, output=output, by=user, why=why)
        return f"step {step_id} of run {run_id} resolved as happened"

    question = (
        f"Run step {step_id} of run {run_id} again?"
        if outcome == "retry"
        else f"Record that step {step_id} of run {run_id} happened, with this output?"
    )
    return Plan(question, act, _back(run_id))


def prepare_raise_budget(c: Console, form: Form, user: str) -> Plan:
    run_id = form.get("run_id", "")
    tokens_text = form.get("tokens", "").strip()
    tokens = whole(tokens_text, "tokens", low=1) if tokens_text else None
    cost = positive(form.get("cost", ""), "cost")
    if tokens is None and cost is None:
        raise Refused(400, "give a new token budget, a new cost budget, or both")
    run = _run(c, run_id)
    if run.status != RunStatus.NEEDS_DECISION or run.decision != Decision.BUDGET:
        raise Refused(409, f"run {run_id} is {run.status}, not waiting on its budget")

    def act(why: str) -> str:
        c.fleet.raise_budget(run_id, tokens=tokens, cost=cost, by=user, why=why)
        return f"raised the budget of run {run_id}"

    limits = " and ".join(
        x for x in (f"{tokens} tokens" if tokens else "", f"${cost}" if cost else "") if x
    )
    return Plan(f"Raise the budget of run {run_id} to {limits}?", act, _back(run_id))


def prepare_replay(c: Console, form: Form, user: str) -> Plan:
    letter = find(c, form.get("letter_id", ""))
    text = form.get("input", "")
    edited: Any = None
    if text.strip():
        # As the page shows it: the store's JSON, secrets as their markers.
        edited = from_recorded(text)
        if not isinstance(edited, (list, dict)):
            raise Refused(
                400, 'input must be a JSON list of arguments or {"args": [...], "kwargs": {...}}'
            )
        if unchanged(edited, letter):  # sent back as shown: replayed as recorded
            edited = None
    if letter.replayed_at is not None:
        raise Refused(409, f"dead letter {letter.id} was already replayed")

    def act(why: str) -> str:
        if edited is None:
            c.fleet.replay(letter.id, by=user, why=why)
        else:
            c.fleet.replay(letter.id, input=edited, by=user, why=why)
        return f"replayed dead letter {letter.id} (step {letter.step_id})"

    changed = " with the edited input" if edited is not None else ""
    question = (
        f"Replay dead letter {letter.id} (step {letter.step_id} of run {letter.run_id}){changed}?"
    )
    return Plan(question, act, _back(letter.run_id))


def prepare_replay_all(c: Console, form: Form, user: str) -> Plan:
    workflow = form.get("workflow", "").strip()
    rate = positive(form.get("rate", ""), "rate", default=5.0)
    assert rate is not None
    if not MIN_RATE <= rate <= MAX_RATE:
        raise Refused(400, f"rate must be {MIN_RATE:g} to {MAX_RATE:g} per second, got {rate:g}")
    ids = [d.id for d in c.fleet.dead_letters(workflow=workflow or None)]
    of = f" of workflow {workflow!r}" if workflow else ""
    if not ids:
        raise Refused(409, f"no dead letter{of} waits for a replay")

    def act(why: str) -> str:
        todo = [d.id for d in c.fleet.dead_letters(workflow=workflow or None)]
        threading.Thread(
            target=replay_paced,
            args=(c, todo, rate, user, why),
            daemon=True,
            name="fleet-console-replay",
        ).start()
        return f"replaying {len(todo)} dead letter(s){of} at {rate:g} per second"

    return Plan(
        f"Replay {len(ids)} dead letter(s){of} at {rate:g} per second?", act, "/dead-letters"
    )


def replay_paced(c: Console, ids: list[int], rate: float, user: str, why: str) -> int:
    """Replay each letter, ``rate`` per second; one already replayed meanwhile is
    skipped (logged). How many were replayed."""
    done = 0
    for i, letter_id in enumerate(ids):
        if i:
            time.sleep(1.0 / rate)
        try:
            c.fleet.replay(letter_id, by=user, why=why)
            done += 1
        except BadInput as exc:
            log.warning("console: replay of dead letter %s skipped: %s", letter_id, exc)
        except Exception:
            log.exception("console: replay of dead letter %s failed", letter_id)
    return done


ACTIONS: dict[str, Prepare] = {
    "cancel": prepare_cancel,
    "signal": prepare_signal,
    "decide": prepare_decide,
    "resolve": prepare_resolve,
    "raise-budget": prepare_raise_budget,
    "replay": prepare_replay,
    "replay-all": prepare_replay_all,
}


def endpoint(c: Console) -> Callable[[Request], Any]:
    async def act(request: Request) -> Response:
        verb = request.path_params["verb"]
        prepare = ACTIONS.get(verb)
        if prepare is None:
            raise Refused(404, f"unknown action {verb!r}")
        user = request.scope["state"]["user"]
        raw = await request.form()
        form = {k: v for k, v in raw.items() if isinstance(v, str)}
        if not c.auth.csrf_ok(user, form.get("csrf", "")):
            raise Refused(403, "this form is stale or not from this console: reload the page")
        no_nul(form, "form field")
        plan = await run_in_threadpool(prepare, c, form, user)
        why = form.get("why", "").strip()
        if form.get("confirm") != "yes":
            hidden = {k: v for k, v in form.items() if k not in CONTROL}
            return page(
                c,
                request,
                "confirm.html",
                verb=verb,
                question=plan.question,
                hidden=hidden,
                why=why,
                back=plan.back,
                title="confirm",
            )
        msg = await run_in_threadpool(plan.act, why)
        return RedirectResponse(f"{root(request)}{plan.back}?{flash_query(c, msg)}", 303)

    return act
