"""Find the ``Fleet`` of an application module (``-A myapp.flows`` or ``myapp.flows:fleet``)."""

from __future__ import annotations

import importlib
import os
import sys

from fleet.app import Fleet
from fleet.errors import BadInput


def load_fleet(target: str | None) -> Fleet:
    """The Fleet named by ``target``, or a bare one for commands that only read the store."""
    if not target:
        return Fleet("fleet")
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `celery -A`: modules in the working directory
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise BadInput(f"cannot import application module {module_name!r}: {exc}") from None
        raise
    if attr:
        found = getattr(module, attr, None)
        if not isinstance(found, Fleet):
            raise BadInput(f"{target!r} is not a fleet.Fleet")
        return found
    preferred = getattr(module, "fleet", None)
    if isinstance(preferred, Fleet):
        return preferred
    candidates = [v for v in vars(module).values() if isinstance(v, Fleet)]
    if len(candidates) != 1:
        raise BadInput(
            f"module {module_name!r} has {len(candidates)} fleet.Fleet instances; "
            f"name one as {module_name}:NAME"
        )
    return candidates[0]
