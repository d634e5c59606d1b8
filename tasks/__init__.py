"""Example agent workflows: the research agent and a notifier (``fleet worker -A tasks``)."""

from tasks import notifier, research
from tasks.app import celery_app, fleet

__all__ = ["celery_app", "fleet", "notifier", "research"]
