"""The ``Fleet`` instance the example workflows register on."""

from __future__ import annotations

from celery import Celery

from fleet import Fleet

fleet: Fleet = Fleet("tasks")
celery_app: Celery = fleet.celery
