"""The record of operators' actions (invariant 13): who did what to which run, and why.

``Fleet``'s steering methods (cancel, signal, resolve, raise_budget, replay) called
with ``by=`` hand the ledger an ``Action``; the ledger method that makes the change
inserts its row (``RECORD``) in the same transaction, after its deciding statement has
applied, so a refused action (the run had ended, the step was not in doubt, the letter
was replayed already) records nothing, and a recorded one cannot have been undone by a
rollback. Rows are read by ``fleet/store/browse.py::Browse.audit``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import String, Text, bindparam, insert

from fleet.errors import BadInput
from fleet.store.predicates import now
from fleet.store.schema import audit

MAX_ACTOR = 200
MAX_TARGET = 300
MAX_WHY = 4000


@dataclass(frozen=True)
class Action:
    """One action about to be made: ``actor`` who (``cli:alice``, a console user),
    ``action`` what (``cancel``, ``signal``, ``resolve``, ``raise_budget``, ``replay``),
    ``target`` on what within the run (a signal's name, a step id, a dead letter),
    ``why`` the operator's words, ``detail`` what else the call said (JSON)."""

    actor: str
    action: str
    target: str | None = None
    why: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)

    def params(self, run_id: str | None) -> dict[str, Any]:
        """``RECORD``'s parameters for this action on ``run_id``."""
        return {
            "b_actor": self.actor,
            "b_action": self.action,
            "b_run": run_id,
            "b_target": None if self.target is None else self.target[:MAX_TARGET],
            "b_why": self.why,
            "b_detail": json.dumps(dict(self.detail), sort_keys=True, default=str)
            if self.detail
            else None,
        }


def action(
    by: str | None,
    why: str | None,
    what: str,
    target: str | None = None,
    **detail: Any,
) -> Action | None:
    """The ``Action`` a steering call made with ``by=`` records (None without ``by``:
    nothing is recorded). A bad ``by`` or ``why`` is ``BadInput`` in one line, before
    anything is changed."""
    if by is None:
        if why:
            raise BadInput("why= is recorded with who acted: pass by= too")
        return None
    if not isinstance(by, str) or not 0 < len(by) <= MAX_ACTOR or not by.isprintable():
        raise BadInput(f"by={by!r:.80} must be 1-{MAX_ACTOR} printable characters naming who acts")
    if why is not None and (not isinstance(why, str) or len(why) > MAX_WHY):
        raise BadInput(f"why= must be text of at most {MAX_WHY} characters")
    kept = {k: v for k, v in detail.items() if v is not None}
    return Action(by, what, target, why or None, kept)


# Stamped with the database's clock, as every other time in the store.
RECORD = insert(audit).values(
    at=now(),
    actor=bindparam("b_actor", type_=String),
    action=bindparam("b_action", type_=String),
    run_id=bindparam("b_run", type_=String),
    target=bindparam("b_target", type_=String),
    why=bindparam("b_why", type_=Text),
    detail=bindparam("b_detail", type_=Text),
)
