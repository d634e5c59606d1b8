"""``Fleet``: the client. It registers workflows and steps, starts and steers runs,
and reads them back; what it changes it changes through the store's ledger, then wakes
a worker through the dispatcher. Celery's app is built in ``fleet.worker.celery_app``,
a run's handle is ``fleet.handle.RunHandle``, the async methods are ``fleet.aio_client``'s,
the steering ones (cancel, signal, resolve, raise_budget, replay) ``fleet.steering``'s."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleet.aio_client import AsyncClient, Enqueues, OffLoop, Waiters, create_run
from fleet.config import Settings
from fleet.errors import BadInput
from fleet.handle import RunHandle
from fleet.limits import Limit
from fleet.policy import RetryPolicy
from fleet.records import DeadLetterInfo, DeadMessageInfo
from fleet.registry import (
    Registry,
    StepDef,
    WorkflowDef,
    check_budget,
    check_limit_names,
    check_name,
)
from fleet.steering import Steering
from fleet.store import migrate
from fleet.store.engine import Database
from fleet.store.ledger import Ledger, NewChild
from fleet.store.queries import Queries
from fleet.transcripts import DEFAULT, TranscriptInfo
from fleet.worker import retention
from fleet.worker.celery_app import make_celery, prepare_broker
from fleet.worker.dispatch import CelerySender, Dispatcher
from fleet.worker.runtime import Runtime
from fleet.worker.tasks import register

log = logging.getLogger("fleet")

MAX_RUN_ID = 200


class Fleet(AsyncClient, Steering):
    """A fleet application: register workflows and steps, enqueue runs, inspect them.

    Settings come from ``FLEET_*`` environment variables unless given here.
    ``fleet.celery`` is a real ``celery.Celery`` (``celery -A module worker`` works).
    Async applications ``await`` the ``a``-methods (``aenqueue``, ``asignal``, ...).
    """

    def __init__(
        self,
        name: str,
        *,
        settings: Settings | None = None,
        database_url: str | None = None,
        broker_url: str | None = None,
        lease_seconds: float | None = None,
        default_retry: RetryPolicy | None = None,
        on_dead_letter: Callable[[DeadLetterInfo], Any] | None = None,
    ) -> None:
        self.name = name
        self.settings = settings or Settings.from_env(
            database_url=database_url, broker_url=broker_url, lease_seconds=lease_seconds
        )
        self.default_retry = default_retry or RetryPolicy()
        self.registry = Registry()
        db = Database(self.settings.database_url)
        ledger = Ledger(db, grace=self.settings.sweep_grace)
        # The broker's channels set bad messages aside in the store through the ledger.
        self.celery = make_celery(name, self.settings, set_aside=ledger.set_aside_message)
        self.runtime = Runtime(
            settings=self.settings,
            db=db,
            ledger=ledger,
            queries=Queries(db),
            registry=self.registry,
            dispatcher=Dispatcher(CelerySender(self.celery)),
        )
        register(self.celery, self.runtime)
        self.off_loop = OffLoop()
        self.enqueues, self.waiters = Enqueues(self), Waiters(self)
        self._schema_checked = False
        self._schema_lock = threading.Lock()  # async callers' first calls come at once
        if on_dead_letter is not None:
            self.on_dead_letter(on_dead_letter)

    def on_dead_letter(
        self, hook: Callable[[DeadLetterInfo], Any]
    ) -> Callable[[DeadLetterInfo], Any]:
        """Call ``hook`` once for each dead letter, in the worker that wrote it (page
        someone, post to chat). A hook that raises is logged, never fatal."""
        self.runtime.dead_letter_hooks.append(hook)
        return hook

    def with_settings(self, settings: Settings) -> Fleet:
        """The same workflows and steps bound to another store and broker (a second
        environment, a test, the demo's scratch folder)."""
        other = Fleet(self.name, settings=settings, default_retry=self.default_retry)
        other.registry.limits.update(self.registry.limits)
        other.registry.steps.update(self.registry.steps)
        other.registry.workflows.update(self.registry.workflows)
        other.runtime.dead_letter_hooks.extend(self.runtime.dead_letter_hooks)
        return other

    # --- definitions --------------------------------------------------------------

    def step(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        non_retryable: tuple[type[BaseException], ...] = (),
        effect: bool = False,
        idempotent: bool = False,
        limits: Sequence[str] = (),
        tokens: Callable[..., Any] | None = None,
    ) -> Any:
        """Register a step: ``@fleet.step`` or ``@fleet.step(retry=..., effect=True)``.
        ``limits=["openai"]``: it starts only when each named ``fleet.limit`` has room;
        ``tokens=lambda *args, **kwargs: N`` the tokens it reserves in them."""

        def decorate(f: Callable[..., Any]) -> StepDef:
            return self.registry.add_step(
                StepDef(
                    name=name or f.__name__,
                    fn=f,
                    retry=retry or self.default_retry,
                    non_retryable=tuple(non_retryable),
                    effect=effect,
                    idempotent=idempotent,
                    limits=check_limit_names(limits, tokens),
                    tokens=tokens,
                )
            )

        return decorate(fn) if fn is not None else decorate

    def limit(
        self,
        name: str,
        *,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
        concurrency: int | None = None,
        per_tenant: bool = False,
    ) -> Limit:
        """Declare a limit every worker shares (a provider's, per API key): a step naming
        it in ``limits=`` starts only when it has room. ``per_tenant``: one per tenant."""
        return self.registry.add_limit(
            Limit(name, requests_per_minute, tokens_per_minute, concurrency, per_tenant)
        )

    def workflow(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        version: str = "1",
        pins: Mapping[str, Any] | None = None,
        budget: Mapping[str, float] | None = None,
    ) -> Any:
        """Register a workflow: ``@fleet.workflow(version="1", pins={"model": ...})``."""

        def decorate(f: Callable[..., Any]) -> WorkflowDef:
            return self.registry.add_workflow(
                WorkflowDef(
                    name=name or f.__name__,
                    fn=f,
                    version=str(version),
                    pins=dict(pins or {}),
                    budget=budget,
                )
            )

        return decorate(fn) if fn is not None else decorate

    # --- the store ------------------------------------------------------------------

    def ensure_schema(self, create: bool = False) -> None:
        """The store must be at the code's schema revision (checked once per Fleet).

        With ``create`` (a worker, ``enqueue``), the embedded SQLite store is created or
        upgraded on first use. Otherwise (reads, operator commands) nothing is created
        or changed: a missing, older or newer store is ``StoreUnavailable`` in one line.
        A server store is only ever migrated on purpose (``fleet db upgrade``)."""
        if self._schema_checked:
            return
        with self._schema_lock:
            if self._schema_checked:
                return
            # The store before the broker folder: the store's folder is created owner-only.
            migrate.check(self.runtime.db, create=create and self.settings.is_sqlite)
            prepare_broker(self.settings)
            self._schema_checked = True

    def upgrade_schema(self) -> None:
        migrate.upgrade(self.runtime.db)
        prepare_broker(self.settings)
        self._schema_checked = True

    # --- runs -------------------------------------------------------------------------

    def enqueue(
        self,
        workflow: WorkflowDef | str,
        *args: Any,
        run_id: str | None = None,
        budget: Mapping[str, float] | None = None,
        tenant: str | None = None,
        **kwargs: Any,
    ) -> RunHandle:
        """Start a run. With ``run_id``, idempotent: the same id twice is one run, started
        once. ``budget={"tokens": N}`` and/or ``{"cost": X}`` (default: the workflow's):
        no step starts once the run's recorded spend reaches it; the run parks as
        ``needs_decision`` until ``raise_budget`` or ``cancel``. ``tenant`` (1-200
        printable characters): whose run it is, stored on it and inherited by its child
        runs (``fleet runs --tenant``, the console filter by it). Enqueued again under
        the same ``run_id`` with another tenant, the run keeps its first one."""
        run = self._new_run(workflow, args, kwargs, run_id, budget, tenant)
        if create_run(run, self.runtime.ledger, self.runtime.queries):
            self.runtime.dispatcher.advance(run.run_id, run.queue)
        return RunHandle(self, run.run_id)

    def _new_run(
        self,
        workflow: WorkflowDef | str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        run_id: str | None,
        budget: Mapping[str, float] | None,
        tenant: str | None,
    ) -> NewChild:
        """``enqueue``'s checks of its input and its arguments' payload: the run to insert
        (``aenqueue`` inserts several of them in one transaction)."""
        wf = self.registry.workflow(workflow)
        if tenant is not None and (
            not isinstance(tenant, str)
            or not 0 < len(tenant) <= MAX_RUN_ID
            or not tenant.isprintable()
        ):
            raise BadInput(f"tenant {tenant!r:.80} must be 1-{MAX_RUN_ID} printable characters")
        wf.check_call(args, kwargs)
        budget_tokens, budget_cost = check_budget(budget if budget is not None else wf.budget)
        if run_id is not None and (
            not run_id or len(run_id) > MAX_RUN_ID or not run_id.isprintable()
        ):
            raise BadInput(f"run id {run_id!r} must be 1-{MAX_RUN_ID} printable characters")
        if run_id is not None and "/" in run_id:
            # A child run's id is "{parent}/{step}": one enqueued under it would stand in
            # for a child its parent has yet to start, and the parent would wait forever.
            raise BadInput(f"run id {run_id!r} has a '/': those are child runs' ids")
        rid = run_id or uuid.uuid4().hex
        pins = wf.encoded_pins()
        self.ensure_schema(create=True)
        payload = self.runtime.payloads.dump(
            {"args": list(args), "kwargs": kwargs}, what=f"arguments of workflow {wf.name}"
        )
        queue = wf.queue(self.settings.queue)
        return NewChild(
            rid,
            wf.name,
            wf.version,
            pins,
            payload,
            queue,
            budget_tokens,
            budget_cost,
            tenant=tenant,
        )

    def run(self, run_id: str) -> RunHandle:
        """A handle for an existing run."""
        self.ensure_schema()
        handle = RunHandle(self, run_id)
        handle.row()
        return handle

    def dead_letters(
        self,
        run_id: str | None = None,
        workflow: str | None = None,
        include_replayed: bool = False,
    ) -> list[DeadLetterInfo]:
        """Dead-lettered steps, oldest first; replayed ones only with ``include_replayed``."""
        self.ensure_schema()
        rows = self.runtime.queries.dead_letters(run_id, workflow, include_replayed)
        return [DeadLetterInfo.from_row(r, self.runtime.payloads.load) for r in rows]

    def transcript(self, run_id: str, name: str = DEFAULT) -> TranscriptInfo:
        """Transcript ``name`` of a run as recorded: every raw message (with the step
        that produced it) and every compaction; ``.window()`` is the model's view.
        Raises ``UnknownRun``; a name the run never wrote to is an empty transcript."""
        check_name(name, "transcript")
        self.run(run_id)
        found, comps = self.runtime.queries.transcript(run_id, name)
        decode = self.runtime.payloads.load
        return TranscriptInfo.from_rows(run_id, name, found, comps, decode)

    # --- retention -----------------------------------------------------------------------

    def prune(
        self, finished_before: float, *, dry_run: bool = False, batch: int = retention.BATCH
    ) -> retention.PruneResult:
        """Delete runs that finished ``finished_before`` seconds ago or earlier, with their
        steps, attempts, intents, signals, dead letters, incidents and the blobs nothing
        else references, ``batch`` runs per short transaction; live runs are never touched.
        A failed run with a dead letter not yet replayed is kept (counted as ``kept``).
        With ``dry_run``, count what would go and delete nothing."""
        self.ensure_schema()
        return retention.prune(self.runtime, finished_before, dry_run=dry_run, batch=batch)

    # --- dead messages: broker messages that were not fleet's ---------------------------

    def dead_messages(self, limit: int = 100) -> list[DeadMessageInfo]:
        """Messages a worker refused (unreadable, or not one of fleet's tasks with valid
        ids) and set aside instead of running: newest first, at most ``limit``."""
        if limit < 0:
            raise BadInput(f"limit must be 0 or more, got {limit}")
        self.ensure_schema()
        return self.runtime.queries.dead_messages(limit)

    def purge_dead_messages(self, ids: list[int] | None = None) -> int:
        """Delete the dead messages with these ids (None: every one); how many went."""
        if ids is not None and any(not 0 < i < 2**31 for i in ids):
            raise BadInput(f"dead message ids are 1 to {2**31 - 1}, got {list(ids)!r:.200}")
        self.ensure_schema()
        return self.runtime.ledger.purge_dead_messages(None if ids is None else list(ids))
