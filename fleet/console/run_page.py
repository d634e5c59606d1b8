"""A run's page (GET ``/runs/{id}``): its status and metadata, its steps by id on a
timeline with their attempts (epochs, workers, durations, retries; fenced writes and
takeovers marked), inputs and outputs clipped (large ones by reference, a transcript
given to a step as a reference to it), its spend and what resume saved, its effects'
write-ahead intents, its child runs as a tree, its waits, its audit, and its
transcripts (paged: ``transcript_view``).

``#run-live`` is the part that moves: ``live_region`` renders it, for the page and
for the run's watcher (``fleet.console.live``), from the same reads. The actions'
forms stay outside it: they carry the user's CSRF token, the live HTML is shared. So
do the transcripts: however long, they are never sent again at each change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from markupsafe import Markup, escape
from starlette.requests import Request
from starlette.responses import Response

from fleet.console.live import stream_response
from fleet.console.pages import checked
from fleet.console.render import Console, Refused, page, root
from fleet.console.transcript_view import shown_input, transcripts
from fleet.errors import PayloadError
from fleet.records import attempts_by_step, saved_by_resume
from fleet.states import AttemptOutcome, RunStatus, StepKind, StepStatus

# Attempts that mark an incident on the timeline: a commit fenced off, a worker lost.
INCIDENT_OUTCOMES = (AttemptOutcome.FENCED, AttemptOutcome.LOST)


@dataclass
class StepView:
    """One step of the timeline with its attempts."""

    row: Any
    attempts: list[Any]
    workers: list[str] = field(default_factory=list)
    tokens: int = 0
    cost: float = 0.0
    incident: bool = False

    @property
    def duration(self) -> float | None:
        r = self.row
        return None if r.finished_at is None else max(0.0, r.finished_at - r.created_at)

    @property
    def workers_text(self) -> str:
        """Its workers, comma-separated (Jinja's ``join`` filter costs ~25 µs a step)."""
        return ", ".join(self.workers)

    @property
    def retries(self) -> int:
        return max(0, self.row.attempts - 1)

    @property
    def wait_name(self) -> str:
        return str(self.row.name).removeprefix("wait:")

    @property
    def named_apart(self) -> bool:
        """Whether its id does not say its function (an explicit key: ``call_read_1``)."""
        return not str(self.row.step_id).startswith(f"{self.row.name}#")

    @property
    def input_text(self) -> str:
        return shown_input(self.row.input)


def step_views(steps: list[Any], attempts: list[Any]) -> list[StepView]:
    by_step = attempts_by_step(attempts)
    views = []
    for s in steps:
        atts = by_step.get(s.step_id, [])
        views.append(
            StepView(
                row=s,
                attempts=atts,
                workers=sorted({a.worker for a in atts}),
                tokens=sum(a.input_tokens + a.output_tokens for a in atts),
                cost=sum(a.cost for a in atts),
                incident=any(a.outcome in INCIDENT_OUTCOMES for a in atts),
            )
        )
    return views


def tree(run_id: str, descendants: list[Any]) -> dict[str, list[Any]]:
    """The child runs under each run id (``descendants`` oldest first)."""
    under: dict[str, list[Any]] = {}
    for child in descendants:
        under.setdefault(child.parent_id or run_id, []).append(child)
    return under


def live_context(c: Console, run_id: str) -> dict[str, Any] | None:
    """Everything ``#run-live`` shows; None for an unknown run."""
    q = c.fleet.runtime.queries
    run = q.run(run_id)
    if run is None:
        return None
    steps, attempts = q.steps(run_id), q.attempts(run_id)
    views = step_views(steps, attempts)
    load = c.fleet.runtime.payloads.load
    try:
        result = load(run.result) if run.result is not None else None
    except PayloadError:
        result = run.result
    return {
        "run": run,
        "status": str(run.status),
        "finished": RunStatus(run.status).finished,
        "result": result,
        "has_result": run.status == RunStatus.SUCCEEDED,
        "steps": views,
        "waits": [v for v in views if v.row.kind == StepKind.WAIT and v.row.finished_at is None],
        "usage": q.usage(run_id),
        "saved": saved_by_resume(attempts),
        "incidents": q.incident_counts(run_id),
        "under": tree(run_id, q.descendants(run_id)),
        "effects": q.intents(run_id),
        "audit": c.browse.audit(run_id=run_id),
        "letters": c.fleet.dead_letters(run_id=run_id, include_replayed=True),
    }


def live_region(c: Console, run_id: str, root: str) -> str:
    """The HTML of ``#run-live``'s content (what the run's watcher sends)."""
    context = live_context(c, run_id)
    if context is None:
        return f"<p>unknown run '{escape(run_id)}'</p>"
    return c.fragment("run_live.html", root=root, **context)


def show(c: Console, request: Request) -> Response:
    run_id = request.path_params["run_id"]
    context = live_context(c, run_id)
    if context is None:
        raise Refused(404, f"unknown run '{run_id}'")
    steps: list[StepView] = context["steps"]
    return page(
        c,
        request,
        "run.html",
        title=run_id,
        # Rendered with autoescape by the same environment: markup, not text.
        live_html=Markup(c.fragment("run_live.html", root=root(request), **context)),
        run=context["run"],
        finished=context["finished"],
        in_doubt=[v.row.step_id for v in steps if v.row.status == StepStatus.IN_DOUBT],
        # (wait id, signal name): a decision answers that one wait (invariant 14).
        open_waits=[
            (v.row.step_id, v.wait_name) for v in context["waits"] if v.row.name.startswith("wait:")
        ],
        letters=context["letters"],
        transcripts=transcripts(c, run_id),
        events="/events/run?" + urlencode({"id": run_id}),
    )


def run_events(c: Console) -> Callable[[Request], Any]:
    """``/events/run?id=RUN``: the run page's ``#run-live`` region, as it changes."""

    async def endpoint(request: Request) -> Response:
        checked(request)
        run_id = request.query_params.get("id", "")
        base = root(request)
        key = ("run", run_id, base)
        if not await c.hub.admit(key, lambda: c.fleet.runtime.queries.run(run_id) is not None):
            raise Refused(404, f"unknown run '{run_id}'")
        return stream_response(
            c.hub.stream(
                key,
                lambda: c.browse.run_fingerprint(run_id),
                lambda: live_region(c, run_id, base),
                c.stream_seconds,
            )
        )

    return endpoint
