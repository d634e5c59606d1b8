"""The ``Fleet`` instance the example workflows register on, and the model provider's
limits they share."""

from __future__ import annotations

from celery import Celery

from fleet import Fleet

fleet: Fleet = Fleet("tasks")
celery_app: Celery = fleet.celery

# A provider limits requests, tokens and concurrent calls per API key: per fleet, so
# declared once here and shared by every worker. Every step that asks the model names
# ``MODEL_LIMITS``; ``per-tenant`` keeps one tenant's many runs (``fleet.enqueue(...,
# tenant=)``) from taking every model call from another tenant's few.
fleet.limit("model", requests_per_minute=500, tokens_per_minute=200_000, concurrency=50)
fleet.limit("per-tenant", concurrency=8, per_tenant=True)
MODEL_LIMITS = ["model", "per-tenant"]
# What a model call reserves in ``model``'s tokens per minute until it reports what it
# spent (``ctx.record_usage``): the stand-in's calls use a few hundred.
CALL_TOKENS = 2_000


def call_tokens(*_args: object, **_kwargs: object) -> int:
    """The tokens a model step reserves, whatever it is asked."""
    return CALL_TOKENS
