"""Tables. Times are seconds since the epoch read from the database's own clock
(``engine.db_now``), so leases and due times do not depend on worker clocks.

Migrations live beside this module (``migrations/``); a change here needs one there.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    Index,
    Integer,
    Text,
    UniqueConstraint,
    text,
)
from sqlmodel import Field, SQLModel

from fleet.states import (
    AttemptOutcome,
    Incident,
    IntentOutcome,
    RunStatus,
    StepKind,
    StepStatus,
    check_constraint,
)

metadata = SQLModel.metadata


class Run(SQLModel, table=True):
    __tablename__ = "fleet_runs"
    __table_args__ = (
        CheckConstraint(check_constraint("status", RunStatus), name="ck_runs_status"),
        Index("ix_runs_status", "status"),
        # Retention lists finished runs by age (fleet prune, FLEET_RETENTION).
        Index("ix_runs_status_finished", "status", "finished_at"),
        # A run's children: cancelled with it, rolled up into its spend, shown as a tree.
        Index("ix_runs_parent", "parent_id"),
        # The console's run list: newest first, keyset on (created_at, id), alone or
        # filtered by status, workflow or tenant (fleet.store.browse).
        Index("ix_runs_created", "created_at", "id"),
        Index("ix_runs_status_created", "status", "created_at", "id"),
        Index("ix_runs_workflow_created", "workflow", "created_at", "id"),
        Index("ix_runs_tenant_created", "tenant", "created_at", "id"),
    )

    id: str = Field(primary_key=True, max_length=200)
    workflow: str = Field(max_length=200)
    version: str = Field(max_length=100)
    pins: str = Field(sa_column=Column(Text, nullable=False, default="{}"))
    args: str = Field(sa_column=Column(Text, nullable=False))
    queue: str = Field(max_length=200)
    status: str = Field(max_length=20)
    result: str | None = Field(default=None, sa_column=Column(Text))
    error: str | None = Field(default=None, sa_column=Column(Text))
    # Every event that needs the workflow replayed bumps wake_seq; an advance that
    # replayed up to it records advanced_seq. The sweeper re-sends advances where
    # advanced_seq < wake_seq, so a lost advance message costs a delay, not the run.
    wake_seq: int = Field(default=0, sa_column=Column(Integer, nullable=False, default=0))
    advanced_seq: int = Field(default=0, sa_column=Column(Integer, nullable=False, default=0))
    redispatch_at: float | None = Field(default=None, sa_column=Column(Float))
    dispatches: int = Field(default=0, sa_column=Column(Integer, nullable=False, default=0))
    created_at: float = Field(sa_column=Column(Float, nullable=False))
    updated_at: float = Field(sa_column=Column(Float, nullable=False))
    finished_at: float | None = Field(default=None, sa_column=Column(Float))
    # Spend limits (None: unlimited); a step never starts once spend has reached them.
    budget_tokens: int | None = Field(default=None, sa_column=Column(BigInteger))
    budget_cost: float | None = Field(default=None, sa_column=Column(Float))
    # Why a run in needs_decision waits: "effect" (an effect in doubt) or "budget".
    decision: str | None = Field(default=None, max_length=20)
    # A child run (wf.child, wf.start_child): its parent run and the parent's step that
    # waits for it. ``detached``: it outlives its parent (not cancelled when it ends).
    parent_id: str | None = Field(default=None, max_length=200)
    parent_step: str | None = Field(default=None, max_length=300)
    detached: bool = Field(default=False, sa_column=Column(Boolean, nullable=False, default=False))
    # Whose run it is (fleet.enqueue(tenant=...)); a child run inherits its parent's.
    tenant: str | None = Field(default=None, max_length=200)


class Step(SQLModel, table=True):
    __tablename__ = "fleet_steps"
    __table_args__ = (
        CheckConstraint(check_constraint("status", StepStatus), name="ck_steps_status"),
        CheckConstraint(check_constraint("kind", StepKind), name="ck_steps_kind"),
        CheckConstraint("attempts >= 0 AND epoch >= 0", name="ck_steps_counters"),
        UniqueConstraint("run_id", "seq", name="uq_steps_seq"),
        Index("ix_steps_status", "status"),
    )

    run_id: str = Field(primary_key=True, max_length=200, foreign_key="fleet_runs.id")
    step_id: str = Field(primary_key=True, max_length=300)
    seq: int
    name: str = Field(max_length=200)
    kind: str = Field(max_length=10)
    input: str = Field(sa_column=Column(Text, nullable=False))
    status: str = Field(max_length=20)
    output: str | None = Field(default=None, sa_column=Column(Text))
    error: str | None = Field(default=None, sa_column=Column(Text))
    attempts: int = 0
    max_attempts: int = 1
    epoch: int = 0
    lease_owner: str | None = Field(default=None, max_length=200)
    lease_expires_at: float | None = Field(default=None, sa_column=Column(Float))
    due_at: float | None = Field(default=None, sa_column=Column(Float))
    redispatch_at: float | None = Field(default=None, sa_column=Column(Float))
    dispatches: int = 0
    created_at: float = Field(sa_column=Column(Float, nullable=False))
    finished_at: float | None = Field(default=None, sa_column=Column(Float))
    # The fan-out (wf.map, wf.parallel) this step is a branch of: the seq of its first
    # branch, a key into fleet_fanouts (None: not a branch).
    fanout: int | None = None


class StepAttempt(SQLModel, table=True):
    """One row per lease taken: who ran it, how it ended, what it spent."""

    __tablename__ = "fleet_attempts"
    __table_args__ = (
        CheckConstraint(check_constraint("outcome", AttemptOutcome), name="ck_attempts_outcome"),
    )

    run_id: str = Field(primary_key=True, max_length=200)
    step_id: str = Field(primary_key=True, max_length=300)
    epoch: int = Field(primary_key=True)
    attempt: int
    worker: str = Field(max_length=200)
    outcome: str = Field(max_length=20)
    error: str | None = Field(default=None, sa_column=Column(Text))
    started_at: float = Field(sa_column=Column(Float, nullable=False))
    finished_at: float | None = Field(default=None, sa_column=Column(Float))
    model: str | None = Field(default=None, max_length=200)
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = Field(default=0.0, sa_column=Column(Float, nullable=False, default=0.0))


class DeadLetter(SQLModel, table=True):
    __tablename__ = "fleet_dead_letters"
    __table_args__ = (Index("ix_dead_letters_run", "run_id"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(max_length=200)
    step_id: str = Field(max_length=300)
    workflow: str = Field(max_length=200)
    name: str = Field(max_length=200)
    input: str = Field(sa_column=Column(Text, nullable=False))
    error_type: str = Field(max_length=200)
    error_message: str = Field(sa_column=Column(Text, nullable=False))
    traceback: str | None = Field(default=None, sa_column=Column(Text))
    attempts: int
    first_failed_at: float = Field(sa_column=Column(Float, nullable=False))
    last_failed_at: float = Field(sa_column=Column(Float, nullable=False))
    replayed_at: float | None = Field(default=None, sa_column=Column(Float))


class IncidentRow(SQLModel, table=True):
    """Fenced writes, duplicate deliveries, takeovers: counted fleet-wide in the store."""

    __tablename__ = "fleet_incidents"
    __table_args__ = (
        CheckConstraint(check_constraint("kind", Incident), name="ck_incidents_kind"),
        Index("ix_incidents_kind", "kind"),
        # Retention deletes a pruned run's incidents by run id.
        Index("ix_incidents_run", "run_id"),
        # The console counts the last hour's incidents by kind and time bucket.
        Index("ix_incidents_at", "at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    kind: str = Field(max_length=30)
    run_id: str | None = Field(default=None, max_length=200)
    step_id: str | None = Field(default=None, max_length=300)
    epoch: int | None = None
    worker: str | None = Field(default=None, max_length=200)
    detail: str | None = Field(default=None, sa_column=Column(Text))
    at: float = Field(sa_column=Column(Float, nullable=False))


class Intent(SQLModel, table=True):
    """Write-ahead intent of an effect step: committed before the body runs."""

    __tablename__ = "fleet_intents"
    __table_args__ = (
        CheckConstraint(check_constraint("outcome", IntentOutcome), name="ck_intents_outcome"),
    )

    run_id: str = Field(primary_key=True, max_length=200)
    step_id: str = Field(primary_key=True, max_length=300)
    epoch: int = Field(primary_key=True)
    idempotency_key: str = Field(max_length=501)
    input_hash: str = Field(max_length=64)
    outcome: str = Field(max_length=20)
    created_at: float = Field(sa_column=Column(Float, nullable=False))
    settled_at: float | None = Field(default=None, sa_column=Column(Float))


class Signal(SQLModel, table=True):
    """An event sent to a run; kept until a wait_for of the same name consumes it."""

    __tablename__ = "fleet_signals"
    __table_args__ = (
        Index("ix_signals_run_name", "run_id", "name"),
        # The few not consumed yet: the sweeper's look for one whose wait is pending.
        Index(
            "ix_signals_unconsumed",
            "run_id",
            "name",
            postgresql_where=text("consumed_at IS NULL"),
            sqlite_where=text("consumed_at IS NULL"),
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(max_length=200)
    name: str = Field(max_length=200)
    payload: str = Field(sa_column=Column(Text, nullable=False))
    created_at: float = Field(sa_column=Column(Float, nullable=False))
    consumed_by: str | None = Field(default=None, max_length=300)
    consumed_at: float | None = Field(default=None, sa_column=Column(Float))


class Blob(SQLModel, table=True):
    """A large input or output, stored once by content hash and referenced."""

    __tablename__ = "fleet_blobs"

    digest: str = Field(primary_key=True, max_length=64)
    size: int
    body: str = Field(sa_column=Column(Text, nullable=False))
    created_at: float = Field(sa_column=Column(Float, nullable=False))


class DeadMessage(SQLModel, table=True):
    """A broker message that was not fleet's (unreadable, or not one of fleet's tasks
    with ids within the limits above): acked, set aside here once, never delivered.
    ``body`` is the raw message, clipped to 64 KiB."""

    __tablename__ = "fleet_dead_messages"

    id: int | None = Field(default=None, primary_key=True)
    queue: str = Field(max_length=200)
    reason: str = Field(sa_column=Column(Text, nullable=False))
    body: str = Field(sa_column=Column(Text, nullable=False))
    at: float = Field(sa_column=Column(Float, nullable=False))


class Message(SQLModel, table=True):
    """One message of a run's transcript, appended once and never rewritten: a
    transcript's positions are 0, 1, 2… ``body`` is inline JSON or a blob reference;
    ``step_id`` the step whose output the message is (None: the workflow wrote it)."""

    __tablename__ = "fleet_messages"

    run_id: str = Field(primary_key=True, max_length=200)
    transcript: str = Field(primary_key=True, max_length=200)
    pos: int = Field(primary_key=True)
    body: str = Field(sa_column=Column(Text, nullable=False))
    step_id: str | None = Field(default=None, max_length=300)
    created_at: float = Field(sa_column=Column(Float, nullable=False))


class Compaction(SQLModel, table=True):
    """A compaction of a transcript: its messages before ``upto`` summarized by step
    ``step_id`` (whose output is the summary), over raw messages from ``start`` led by
    compaction ``base``'s summary, if any. Recorded beside the raw messages; a later
    one supersedes it; none deletes anything."""

    __tablename__ = "fleet_compactions"

    run_id: str = Field(primary_key=True, max_length=200)
    transcript: str = Field(primary_key=True, max_length=200)
    number: int = Field(primary_key=True)
    start: int
    upto: int
    base: int | None = None
    step_id: str = Field(max_length=300)
    created_at: float = Field(sa_column=Column(Float, nullable=False))


class Fanout(SQLModel, table=True):
    """A fan-out's branches (wf.map, wf.parallel), recorded together: ``size`` of them,
    ``settled`` of which are done or dead. A branch that settles before the last does
    not replay the run; the last one does."""

    __tablename__ = "fleet_fanouts"

    run_id: str = Field(primary_key=True, max_length=200)
    fanout: int = Field(primary_key=True)
    size: int
    settled: int = 0


class Audit(SQLModel, table=True):
    """One operator's action on the fleet (cancel, signal, resolve, raise budget,
    replay): who, what, on which run and target, why; written in the transaction of
    the change it records, never for a refused one."""

    __tablename__ = "fleet_audit"
    __table_args__ = (
        Index("ix_audit_run_at", "run_id", "at"),
        Index("ix_audit_at", "at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    at: float = Field(sa_column=Column(Float, nullable=False))
    actor: str = Field(max_length=200)
    action: str = Field(max_length=40)
    run_id: str | None = Field(default=None, max_length=200)
    target: str | None = Field(default=None, max_length=300)
    why: str | None = Field(default=None, sa_column=Column(Text))
    detail: str | None = Field(default=None, sa_column=Column(Text))


class LimitState(SQLModel, table=True):
    """One row per limit key in use (``name``, or ``name#tenant``): what a starting
    step locks while it decides (so the decision is atomic across workers) and until
    when the limit is paused (a provider's 429: ``Retry(limit=...)``)."""

    __tablename__ = "fleet_limit_state"

    limit_key: str = Field(primary_key=True, max_length=400)
    paused_until: float | None = Field(default=None, sa_column=Column(Float))


class LimitSlot(SQLModel, table=True):
    """A step holding a concurrency slot of a limit: by the delivery that took it
    (``token``); it lapses at ``expires_at`` unless its worker renews it."""

    __tablename__ = "fleet_limit_slots"

    limit_key: str = Field(primary_key=True, max_length=400)
    run_id: str = Field(primary_key=True, max_length=200)
    step_id: str = Field(primary_key=True, max_length=300)
    token: str = Field(max_length=64)
    acquired_at: float = Field(sa_column=Column(Float, nullable=False))
    expires_at: float = Field(sa_column=Column(Float, nullable=False))


class LimitEvent(SQLModel, table=True):
    """A step started under a rated limit: one request and the tokens it reserved
    (settled with what it reported); counted while younger than a minute."""

    __tablename__ = "fleet_limit_events"
    __table_args__ = (
        Index("ix_limit_events_key_at", "limit_key", "at"),
        Index("ix_limit_events_token", "token"),
    )

    id: int | None = Field(default=None, primary_key=True)
    limit_key: str = Field(max_length=400)
    token: str = Field(max_length=64)
    at: float = Field(sa_column=Column(Float, nullable=False))
    tokens: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, default=0))
    # Whose run it was: waiting steps of a tenant that used less go first.
    tenant: str = Field(default="-", max_length=200)


class LimitWait(SQLModel, table=True):
    """A step that found a limit without room: since when it waits, when it last
    looked and when it looks again (its message's countdown: a delivery due sooner is
    a duplicate, dropped). Gone once it starts; what ``fleet limits`` counts."""

    __tablename__ = "fleet_limit_waits"

    limit_key: str = Field(primary_key=True, max_length=400)
    run_id: str = Field(primary_key=True, max_length=200)
    step_id: str = Field(primary_key=True, max_length=300)
    why: str = Field(max_length=20)
    since: float = Field(sa_column=Column(Float, nullable=False))
    seen_at: float = Field(sa_column=Column(Float, nullable=False))
    due_at: float = Field(sa_column=Column(Float, nullable=False))
    tenant: str = Field(default="-", max_length=200)


class PrunedTotal(SQLModel, table=True):
    """What retention deleted, kept as totals (fleet/store/totals.py): per counter and
    label set (a JSON list of the label values), the sum of the deleted rows' counts or
    amounts. The metrics add these to the live rows' figures, so a counter never goes
    back when its rows are pruned."""

    __tablename__ = "fleet_pruned_totals"

    counter: str = Field(primary_key=True, max_length=100)
    labels: str = Field(sa_column=Column(Text, primary_key=True))
    value: float = Field(default=0.0, sa_column=Column(Float, nullable=False, default=0.0))


runs = Run.__table__  # type: ignore[attr-defined]
steps = Step.__table__  # type: ignore[attr-defined]
attempts = StepAttempt.__table__  # type: ignore[attr-defined]
dead_letters = DeadLetter.__table__  # type: ignore[attr-defined]
incidents = IncidentRow.__table__  # type: ignore[attr-defined]
intents = Intent.__table__  # type: ignore[attr-defined]
signals = Signal.__table__  # type: ignore[attr-defined]
blobs = Blob.__table__  # type: ignore[attr-defined]
dead_messages = DeadMessage.__table__  # type: ignore[attr-defined]
messages = Message.__table__  # type: ignore[attr-defined]
compactions = Compaction.__table__  # type: ignore[attr-defined]
fanouts = Fanout.__table__  # type: ignore[attr-defined]
audit = Audit.__table__  # type: ignore[attr-defined]
limit_state = LimitState.__table__  # type: ignore[attr-defined]
limit_slots = LimitSlot.__table__  # type: ignore[attr-defined]
limit_events = LimitEvent.__table__  # type: ignore[attr-defined]
limit_waits = LimitWait.__table__  # type: ignore[attr-defined]
pruned_totals = PrunedTotal.__table__  # type: ignore[attr-defined]
