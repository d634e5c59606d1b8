"""The transition table agrees with the status enums, with the schema's CHECK
constraints, and with the statements built from it; typed rows agree with their
tables."""

from __future__ import annotations

from dataclasses import fields
from enum import StrEnum
from typing import Any

import pytest
from sqlalchemy import CheckConstraint
from sqlalchemy.dialects import postgresql, sqlite

from fleet.records import DeadMessageInfo
from fleet.states import TRANSITIONS, RunStatus, StepKind, StepStatus, Transition
from fleet.store import rows, schema, transitions
from fleet.store.schema import runs, steps

ENUMS: dict[str, type[StrEnum]] = {"run": RunStatus, "step": StepStatus}
TABLES = {"run": runs, "step": steps}


def _statuses(transition: Transition) -> set[str]:
    return {*transition.sources, transition.target}


def test_every_status_in_the_table_is_a_member_of_its_subjects_enum() -> None:
    for t in TRANSITIONS.values():
        enum = ENUMS[t.subject]
        assert all(isinstance(s, enum) for s in _statuses(t)), t.name
        assert t.sources, f"{t.name} has no source"


def test_the_schema_allows_exactly_the_enums_statuses() -> None:
    for subject, table in TABLES.items():
        (check,) = [
            c
            for c in table.constraints
            if isinstance(c, CheckConstraint) and c.name == f"ck_{table.name[6:]}_status"
        ]
        allowed = set(str(check.sqltext).split("(", 1)[1].rstrip(")").replace("'", "").split(", "))
        assert allowed == {s.value for s in ENUMS[subject]}
        used = set().union(*(_statuses(t) for t in TRANSITIONS.values() if t.subject == subject))
        assert used <= allowed


@pytest.mark.parametrize("subject", ["run", "step"])
def test_every_status_is_reached_and_every_unfinished_one_is_left(subject: str) -> None:
    """No status the table cannot lead to (bar the ones a row is created in) and no
    unfinished status a row could be stuck in."""
    enum = ENUMS[subject]
    entries = [t for t in TRANSITIONS.values() if t.subject == subject]
    created_in: set[str] = {RunStatus.QUEUED} if subject == "run" else {StepStatus.PENDING}
    assert {t.target for t in entries} | created_in == set(enum)
    unfinished = {s for s in enum if not s.finished}  # type: ignore[attr-defined]
    assert unfinished <= set().union(*(t.sources for t in entries))


def test_every_table_entry_has_a_statement_built_from_it() -> None:
    assert set(TRANSITIONS) == transitions.BUILT


def test_a_transition_statement_checks_its_sources_and_sets_its_target() -> None:
    for limited in (True, False):
        take = str(transitions.TAKE[limited].compile(dialect=postgresql.dialect()))
        sources = ", ".join(f"'{s}'" for s in sorted(TRANSITIONS["take_lease"].sources))
        assert f"fleet_steps.status IN ({sources})" in take
    commit = transitions.COMMIT.compile(dialect=sqlite.dialect())
    assert commit.params["status"] == StepStatus.DONE


def test_fenced_transitions_leave_running_only() -> None:
    """A statement fenced by the epoch held (``held``) can only apply to a running step."""
    for name in ("commit_output", "schedule_retry", "dead_letter", "park_in_doubt"):
        assert TRANSITIONS[name].sources == {StepStatus.RUNNING}


@pytest.mark.parametrize(
    ("row", "table"),
    [
        (rows.RunRow, runs),
        (rows.StepRow, steps),
        (rows.AttemptRow, schema.attempts),
        (rows.IntentRow, schema.intents),
        (rows.DeadLetterRow, schema.dead_letters),
        (DeadMessageInfo, schema.dead_messages),
    ],
)
def test_a_typed_row_has_its_tables_columns_in_order(row: type, table: Any) -> None:
    """``from_row`` builds a row positionally from ``SELECT <table>``."""
    assert [f.name for f in fields(row)] == list(table.c.keys())


def test_a_typed_row_holds_enums() -> None:
    values = dict.fromkeys(steps.c.keys()) | {"kind": "task", "status": "done"}
    step = rows.StepRow.from_row(tuple(values.values()))
    assert (type(step.kind), type(step.status)) == (StepKind, StepStatus)
