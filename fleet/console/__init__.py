"""The operator's console: a web page for runs, steps, conversations, approvals, dead
letters and spend (``fleet console``, or ``fleet.console.app(fleet)`` mounted in an
ASGI service). Needs the ``console`` extra (Starlette, Jinja2, python-multipart,
uvicorn)."""

from fleet.console.factory import app

__all__ = ["app"]
