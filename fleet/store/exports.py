"""A run's recorded history as one JSON document (``fleet export``), and that document
read back as the reads a replay makes (``Exported``): a replay from the file runs the
same code over the same rows as a replay from the store (fleet/worker/replayer.py).

The document (``FORMAT``, ``VERSION``) holds the rows as the store keeps them: the
run's row (its workflow, version and pins, its arguments, its result or error), its
steps with their inputs, outputs and errors, its transcripts' messages and
compactions, the signals sent to it, its child runs' ends, its spend, and the text of
every large value those rows reference (``blobs``: digest → text, each once).
Recorded values stay the texts the store holds, decoded by the same code either way: a
secret is its ``{"$fleet_secret": NAME}`` marker (its value is never in the store, so
never in the file), a large value its ``blob:<sha256>`` reference.

Exporting only reads, in one transaction. Reading a document checks each row it reads
and names the first that is wrong (``BadInput``); what a replay does not read
(compactions, signals, children) is carried for the reader of the file, unchecked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.engine import Connection

from fleet.errors import BadInput
from fleet.states import StepStatus
from fleet.store.engine import Database
from fleet.store.message_cache import EMPTY, Recorded
from fleet.store.messages import BLOB, SAME_AS_OUTPUT, with_blobs
from fleet.store.predicates import RUN
from fleet.store.queries import Queries
from fleet.store.rows import RunRow, StepRow
from fleet.store.schema import blobs, compactions, messages, runs, signals
from fleet.store.snapshots import HISTORY, RUN_ROW, Snapshot

FORMAT = "fleet-run-history"
VERSION = 1
# The largest history file read: a 5,000-turn agent's run exports about 25 MB.
MAX_FILE_BYTES = 1 << 30
_BLOB_BATCH = 500  # digests asked for in one statement

_MESSAGES = (
    select(
        messages.c.transcript,
        messages.c.pos,
        messages.c.body,
        messages.c.step_id,
        messages.c.created_at,
    )
    .where(messages.c.run_id == RUN)
    .order_by(messages.c.transcript, messages.c.pos)
)
_COMPACTIONS = (
    select(
        compactions.c.transcript,
        compactions.c.number,
        compactions.c.start,
        compactions.c.upto,
        compactions.c.base,
        compactions.c.step_id,
        compactions.c.created_at,
    )
    .where(compactions.c.run_id == RUN)
    .order_by(compactions.c.transcript, compactions.c.number)
)
_SIGNALS = (
    select(
        signals.c.id,
        signals.c.name,
        signals.c.payload,
        signals.c.created_at,
        signals.c.consumed_by,
        signals.c.consumed_at,
    )
    .where(signals.c.run_id == RUN)
    .order_by(signals.c.id)
)
_CHILDREN = (
    select(
        runs.c.id,
        runs.c.workflow,
        runs.c.version,
        runs.c.status,
        runs.c.result,
        runs.c.error,
        runs.c.detached,
        runs.c.finished_at,
    )
    .where(runs.c.parent_id == RUN)
    .order_by(runs.c.created_at, runs.c.id)
)


def export_run(queries: Queries, run_id: str) -> dict[str, Any] | None:
    """Run ``run_id``'s history as the document (None: no such run), read through
    ``queries``' store in one transaction; its spend (``Queries.usage``) after it."""
    params = {"b_run": run_id}
    with queries.db.begin(read=True) as conn:
        # The run first, its steps after its messages: on Postgres a statement sees what
        # had committed when it began. A run read as ended has every row written; a
        # message recorded as its step's output is written once that step is done, so
        # the steps read after it hold that output.
        found = conn.execute(RUN_ROW, params).first()
        if found is None:
            return None
        run = RunRow.from_row(found)
        said = [dict(r) for r in conn.execute(_MESSAGES, params).mappings()]
        compacted = [dict(r) for r in conn.execute(_COMPACTIONS, params).mappings()]
        steps = [StepRow.from_row(r) for r in conn.execute(HISTORY, params)]
        sent = [dict(r) for r in conn.execute(_SIGNALS, params).mappings()]
        children = [dict(r) for r in conn.execute(_CHILDREN, params).mappings()]
        texts = [
            run.args,
            run.result,
            *(s.input for s in steps),
            *(s.output for s in steps),
            *(m["body"] for m in said),
            *(s["payload"] for s in sent),
            *(c["result"] for c in children),
        ]
        large = _blobs(conn, texts)
    return {
        "format": FORMAT,
        "version": VERSION,
        "run": asdict(run),
        "steps": [asdict(s) for s in steps],
        "messages": said,
        "compactions": compacted,
        "signals": sent,
        "children": children,
        "usage": queries.usage(run_id),
        "blobs": large,
    }


def _blobs(conn: Connection, texts: Iterable[str | None]) -> dict[str, str]:
    """The text of every blob ``texts`` reference, by digest, in digest order."""
    digests = sorted({t[len(BLOB) :] for t in texts if t is not None and t.startswith(BLOB)})
    found: dict[str, str] = {}
    for i in range(0, len(digests), _BLOB_BATCH):
        batch = digests[i : i + _BLOB_BATCH]
        stmt = select(blobs.c.digest, blobs.c.body).where(blobs.c.digest.in_(batch))
        found.update((digest, body) for digest, body in conn.execute(stmt))
    return {d: found[d] for d in digests if d in found}


# --- the document read back ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Said:
    """One message of an exported transcript, as the store keeps it."""

    transcript: str
    pos: int
    body: str
    step_id: str | None
    created_at: float


@dataclass(frozen=True, slots=True)
class Spent:
    """An exported run's spend (``Queries.usage``)."""

    calls: int
    input_tokens: int
    output_tokens: int
    tokens: int
    cost: float


def load(source: str | os.PathLike[str] | Mapping[str, Any]) -> Exported:
    """The history in ``source``: a file ``fleet export`` wrote, or its document
    already loaded. ``BadInput`` in one line naming what is wrong."""
    if isinstance(source, Mapping):
        return Exported.of(source)
    return Exported.of(read_file(Path(source)))


def read_file(path: Path) -> Any:
    """The JSON document in ``path``, at most ``MAX_FILE_BYTES``."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise BadInput(f"history file {path} is {size} bytes, over {MAX_FILE_BYTES}")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"history file {path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise BadInput(f"history file {path} is not UTF-8 text") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise BadInput(f"history file {path} is not JSON: {exc}") from None


class Exported(Queries):
    """An exported history's answers to the reads a replay makes (``run``,
    ``snapshot``, ``steps``, ``step``, ``recorded``, ``summary``, ``blob``, ``usage``),
    from the rows as the store would return them. Its ``db`` is an in-memory database
    with no tables: the replay's caches live on it, and any other read or write fails
    there, touching nothing."""

    def __init__(
        self,
        run: RunRow,
        steps: Sequence[StepRow],
        said: Sequence[Said],
        large: Mapping[str, str],
        spent: Spent,
    ) -> None:
        super().__init__(Database("sqlite://"))
        self.run_id = run.id
        self._run = run
        self._steps = tuple(sorted(steps, key=lambda s: s.seq))  # as HISTORY orders them
        self._by_id = {s.step_id: s for s in self._steps}
        self._said: dict[str, list[Said]] = {}
        for m in sorted(said, key=lambda m: (m.transcript, m.pos)):
            self._said.setdefault(m.transcript, []).append(m)
        self._blobs = dict(large)
        self._spent = spent

    @classmethod
    def of(cls, document: Mapping[str, Any]) -> Exported:
        """The history in ``document``; ``BadInput`` naming the first thing wrong."""
        if not isinstance(document, Mapping) or document.get("format") != FORMAT:
            raise BadInput(
                f'not a fleet history (fleet export writes one): no "format": "{FORMAT}"'
            )
        version = document.get("version")
        if version != VERSION or isinstance(version, bool):
            raise BadInput(f"fleet history version {version!r}: this fleet reads version {VERSION}")
        run = _row(RunRow, document.get("run"), "the history's run")
        steps = [_row(StepRow, s, f"step {i} of the history") for i, s in _items(document, "steps")]
        said = [
            _row(Said, m, f"message {i} of the history") for i, m in _items(document, "messages")
        ]
        large = document.get("blobs")
        if not isinstance(large, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in large.items()
        ):
            raise BadInput("the history's blobs are not an object of texts by digest")
        history = cls(run, steps, said, large, _row(Spent, document.get("usage"), "its usage"))
        history._check()
        return history

    def _check(self) -> None:
        """The rows hold together as the store's do: one run, each step id once, each
        transcript's positions 0, 1, 2…"""
        for s in self._steps:
            if s.run_id != self.run_id:
                raise BadInput(f"step {s.step_id!r} of the history is of run {s.run_id!r}")
        if len(self._by_id) != len(self._steps):
            raise BadInput("the history holds a step id twice")
        for name, said in self._said.items():
            for pos, m in enumerate(said):
                if m.pos != pos:
                    raise BadInput(f"transcript {name!r} of the history has no message {pos}")

    def run(self, run_id: str) -> RunRow | None:
        return self._run if run_id == self.run_id else None

    def snapshot(self, run_id: str) -> Snapshot | None:
        return Snapshot(self._run, list(self._steps)) if run_id == self.run_id else None

    def steps(self, run_id: str) -> list[StepRow]:
        return list(self._steps) if run_id == self.run_id else []

    def step(self, run_id: str, step_id: str) -> StepRow | None:
        return self._by_id.get(step_id) if run_id == self.run_id else None

    def recorded(
        self, run_id: str, created_at: float, name: str, end: int | None = None
    ) -> Recorded:
        """As ``Queries.recorded`` reads them (``messages.MESSAGES_FROM``): a message
        recorded as its step's output is that output's text."""
        said = self._said.get(name, [])[:end] if run_id == self.run_id else []
        bodies = [self._output(m.step_id) if m.body == SAME_AS_OUTPUT else m.body for m in said]
        outputs = [m.step_id if m.body == SAME_AS_OUTPUT else None for m in said]
        return EMPTY.grown(with_blobs(bodies, self._blobs), outputs)

    def summary(self, run_id: str, created_at: float, step_id: str) -> str | None:
        row = self.step(run_id, step_id)
        if row is None or row.status is not StepStatus.DONE or row.output is None:
            return None
        return with_blobs([row.output], self._blobs)[0]

    def blob(self, digest: str) -> str | None:
        return self._blobs.get(digest)

    def usage(self, run_id: str) -> dict[str, Any]:
        return asdict(self._spent)

    def _output(self, step_id: str | None) -> str | None:
        row = self._by_id.get(step_id or "")
        return None if row is None else row.output


# --- checks of the rows read ----------------------------------------------------------

R = TypeVar("R")
# A field's declared type → the JSON values it takes (an enum: its text).
_JSON: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
}


def _items(document: Mapping[str, Any], key: str) -> Iterable[tuple[int, Any]]:
    found = document.get(key)
    if not isinstance(found, list):
        raise BadInput(f"the history's {key} are not a list")
    return enumerate(found)


def _row(cls: type[R], record: Any, what: str) -> R:
    """``record`` (a JSON object) as a ``cls``, each of its fields checked against its
    declared type; ``BadInput`` naming ``what`` and the field otherwise."""
    if not isinstance(record, Mapping):
        raise BadInput(f"{what} is not a JSON object")
    declared = fields(cls)  # type: ignore[arg-type]
    missing = [f.name for f in declared if f.name not in record]
    if missing:
        raise BadInput(f"{what} lacks {', '.join(missing)}")
    for f in declared:
        value, kinds = record[f.name], str(f.type).split(" | ")
        if value is None and "None" in kinds:
            continue
        wanted = tuple(t for k in kinds if k != "None" for t in _JSON.get(k, (str,)))
        if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
            raise BadInput(f"{what}: {f.name} should be {f.type}, not {type(value).__name__}")
    try:
        return cls(**{f.name: record[f.name] for f in declared})
    except ValueError as exc:  # a status or kind that is none of its enum's
        raise BadInput(f"{what}: {exc}") from None
