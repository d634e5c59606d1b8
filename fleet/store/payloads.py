"""Recorded values: strict JSON inline up to ``max_payload_bytes``; larger ones stored
once by content hash (``fleet_blobs``) and referenced as ``blob:<sha256>``, up to the
hard ``max_blob_bytes``. A reference is not valid JSON, so it cannot be confused with
a value.

A recorded value that cannot be loaded (a corrupt row, a secret marker with a bad name,
a missing blob) raises ``PayloadError``: a fact about the row, so the caller fails the
run or dead-letters the step instead of trying again. Only ``StoreUnavailable`` (the
store could not be read) is worth another try."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

from fleet import codec
from fleet.config import Settings
from fleet.errors import PayloadError
from fleet.store.history import COPY, FRESH, SHARE
from fleet.store.ledger import Ledger
from fleet.store.message_cache import fresh_copy
from fleet.store.queries import Queries
from fleet.store.rows import StepRow

BLOB = "blob:"


class Payloads:
    def __init__(self, settings: Settings, ledger: Ledger, queries: Queries) -> None:
        self.settings = settings
        self.ledger = ledger
        self.queries = queries
        self._outputs = queries.db.history.outputs  # this process's decoded outputs

    def dump(self, value: Any, what: str) -> str:
        return self.store(codec.encode(value, what=what, limit=self.settings.max_blob_bytes))

    def store(self, text: str) -> str:
        """An encoded value as recorded: inline, or by reference once over the limit."""
        if len(text.encode()) <= self.settings.max_payload_bytes:
            return text
        digest = hashlib.sha256(text.encode()).hexdigest()
        self.ledger.put_blob(digest, text)
        return BLOB + digest

    def load(self, text: str | None) -> Any:
        if text is None:
            return None
        if not text.startswith(BLOB):
            if len(text) <= _SCALAR_TEXT and text[:1] not in ("{", "["):
                return _scalar(text)
            return codec.decode(text)
        return codec.decode(self._blob(text))

    def _blob(self, text: str) -> str:
        body = self.queries.blob(text[len(BLOB) :])
        if body is None:
            raise PayloadError(f"stored value {text} is missing from fleet_blobs")
        return body

    def output(self, row: StepRow) -> Any:
        """The recorded output of ``row`` (a done step), equal to ``load(row.output)``
        and the caller's own to change, decoded once per process (``DecodedOutputs``,
        fleet/store/history.py): a replay hands out every recorded output again."""
        outputs = self._outputs
        entry = outputs.get(row)
        if entry is None:
            text = row.output
            if text is None:
                return None
            body = self._blob(text) if text.startswith(BLOB) else text
            entry = outputs.keep(row, codec.decode(body), len(body))
        _, mode, value, _ = entry
        if mode == SHARE:
            return value
        if mode == COPY:
            return value.copy()
        if mode == FRESH:
            return fresh_copy(value)
        return self.load(row.output)  # not plain JSON (a secret, a cursor): decoded again

    def load_call(self, text: str, what: str) -> tuple[list[Any], dict[str, Any]]:
        """The recorded arguments of a workflow or step call (``{"args", "kwargs"}``);
        ``PayloadError`` naming ``what`` if they cannot be loaded."""
        try:
            call = self.load(text)
        except PayloadError as exc:
            raise PayloadError(f"{what} cannot be loaded: {exc}") from None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("args"), list)
            or not isinstance(call.get("kwargs"), dict)
        ):
            raise PayloadError(f"{what} cannot be loaded: it is not an args and kwargs record")
        return call["args"], call["kwargs"]


# A replay decodes every recorded output again. Short scalars (null, numbers, true,
# short strings) are immutable, so their decoded values are shared; objects and
# arrays are decoded afresh each time, since a workflow may change what it is given.
_SCALAR_TEXT = 128


@lru_cache(maxsize=4096)
def _scalar(text: str) -> Any:
    return codec.decode(text)
