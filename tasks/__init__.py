"""Example agent workflows: the research agent, a notifier and the notes agent
(``fleet worker -A tasks``)."""

from tasks import agent, notifier, research
from tasks.app import celery_app, fleet

__all__ = ["agent", "celery_app", "fleet", "notifier", "research"]
