"""The notes agent behind a FastAPI app: fleet's async client in a web service.

    uvicorn tasks.web:app              # the store and broker from FLEET_* (as the worker)
    fleet worker -A tasks              # runs what the app enqueues

``POST /runs`` with an ``Idempotency-Key`` header starts an agent run (``tasks/agent.py``)
whose run id is made from that key, so a client that retries the request (a timeout, a
double click) gets the same run, started once. ``GET /runs/{id}/events`` streams the
run's progress as server-sent events until it ends; ``POST /runs/{id}/approval`` lets a
person approve (or refuse) the destructive tool call the run waits on. Every fleet call
is awaited (``aenqueue``, ``asignal``, ``astatus``...): no request ever blocks the loop
that serves the others.

``create_app(fleet)`` builds the app on any ``Fleet`` with the agent registered (the
tests pass one bound to their store); ``app`` is the one on ``tasks.app.fleet``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from fleet import BadInput, Fleet, RunFailed, RunHandle, StepInfo, UnknownRun
from fleet.states import RunStatus
from tasks.agent import TASK
from tasks.app import fleet as tasks_fleet

KEY = re.compile(r"[A-Za-z0-9._:-]{1,100}")
RUN_PREFIX = "web-"
POLL_SECONDS = 0.25  # how often a stream looks at its run
KEEPALIVE_POLLS = 60  # a comment line after this many quiet polls keeps proxies from closing


class StartRun(BaseModel):
    task: str = Field(default=TASK, min_length=1, max_length=4000)


class Approval(BaseModel):
    """The payload ``wf.wait_for("approval")`` gets (as the operator's console sends it)."""

    approved: bool
    by: str = Field(min_length=1, max_length=200)
    comment: str = Field(default="", max_length=2000)


def _run_id(key: str) -> str:
    """The run id of a request key: one key, one run."""
    if not KEY.fullmatch(key):
        raise HTTPException(400, "Idempotency-Key must be 1-100 of A-Z a-z 0-9 . _ : -")
    return RUN_PREFIX + key


def _refused(exc: BadInput) -> HTTPException:
    """fleet's one-line refusals as HTTP: an unknown run is 404, a run that has ended
    (or a key already used otherwise) a conflict."""
    return HTTPException(404 if isinstance(exc, UnknownRun) else 409, str(exc))


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, sort_keys=True)}\n\n"


async def progress(run: RunHandle, poll: float = POLL_SECONDS) -> AsyncIterator[str]:
    """The run's progress as server-sent events: ``status`` when the run's status
    changes, ``step`` when a step starts, retries or ends, then one ``end`` (with the
    result or the error) when the run ends. Each look at the store is awaited."""
    status, quiet = "", 0
    seen: dict[str, tuple[str, int]] = {}
    while True:
        # The status first: once it says ended, the steps read after it are final.
        now = await run.astatus()
        steps = await run.asteps()
        if now != status:
            status = now
            yield _sse("status", {"run_id": run.id, "status": status})
        changed = [s for s in steps if seen.get(s.id) != (s.status, s.attempts)]
        for s in changed:
            seen[s.id] = (s.status, s.attempts)
            yield _sse("step", _step(s))
        if RunStatus(status).finished:
            yield _sse("end", await _outcome(run))
            return
        quiet = 0 if changed else quiet + 1
        if quiet >= KEEPALIVE_POLLS:
            quiet = 0
            yield ": keep-alive\n\n"
        await asyncio.sleep(poll)


def _step(s: StepInfo) -> dict[str, Any]:
    return {
        "id": s.id,
        "name": s.name,
        "status": s.status,
        "attempts": s.attempts,
        "error": s.error,
    }


async def _outcome(run: RunHandle) -> dict[str, Any]:
    try:
        return {"run_id": run.id, "status": "succeeded", "result": await run.aresult(timeout=0)}
    except RunFailed as exc:
        return {"run_id": run.id, "status": exc.status, "error": exc.error}


def create_app(fleet: Fleet = tasks_fleet, poll: float = POLL_SECONDS) -> FastAPI:
    """The web app over ``fleet``; ``poll`` is how often an event stream reads its run."""
    app = FastAPI(title="notes agent", description=__doc__)

    @app.post("/runs", status_code=202)
    async def start_run(
        idempotency_key: Annotated[str, Header()], body: StartRun | None = None
    ) -> dict[str, str]:
        """Start the agent on ``task``; the same key again is the same run."""
        task = (body or StartRun()).task
        try:
            run = await fleet.aenqueue("agent", task, run_id=_run_id(idempotency_key))
        except BadInput as exc:
            raise _refused(exc) from None
        return {"run_id": run.id, "status": await run.astatus()}

    @app.get("/runs/{run_id}")
    async def show_run(run_id: str) -> dict[str, Any]:
        try:
            run = await fleet.arun(run_id)
        except UnknownRun as exc:
            raise _refused(exc) from None
        steps = await run.asteps()
        return {"run_id": run.id, "status": await run.astatus(), "steps": [_step(s) for s in steps]}

    @app.get("/runs/{run_id}/events")
    async def run_events(run_id: str) -> StreamingResponse:
        """Server-sent events until the run ends (``EventSource`` in a browser)."""
        try:
            run = await fleet.arun(run_id)
        except UnknownRun as exc:
            raise _refused(exc) from None
        return StreamingResponse(
            progress(run, poll),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/runs/{run_id}/approval", status_code=202)
    async def approve(run_id: str, approval: Approval) -> dict[str, str]:
        """Send the ``approval`` signal: the run goes on (now, or when it comes to wait)."""
        try:
            await fleet.asignal(run_id, "approval", approval.model_dump())
        except BadInput as exc:
            raise _refused(exc) from None
        return {"run_id": run_id, "status": "sent"}

    return app


app = create_app()
