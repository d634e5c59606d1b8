"""``fleet worker --pool gevent`` (or eventlet): monkey-patch before anything else is
imported, as ``celery worker`` does in its own entry point. Imported first by
``fleet/__init__.py``; without it, a blocking call in a step (``time.sleep``, a socket
read, a model call) would hold the whole worker instead of one greenlet."""

from __future__ import annotations

import sys


def patch_for_worker_pool(argv: list[str]) -> None:
    if len(argv) > 1 and argv[1] == "worker":
        from celery import maybe_patch_concurrency

        maybe_patch_concurrency(argv, short_opts=["-P"], long_opts=["--pool"])


patch_for_worker_pool(sys.argv)
