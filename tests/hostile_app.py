"""An application whose names, ids and errors hold Rich markup and a Secret, for the
hostile-input tests of the command line (tests/e2e/test_cli_hostile.py)."""

from __future__ import annotations

from typing import Any

from fleet import Fleet, NonRetryable, Secret, StepContext, WorkflowContext

# Each would be read as markup: "[/]" closes nothing (a crash), "[link=…]" hides
# its target, "[bold]" styles. The operator must see them as typed. A workflow's name
# cannot hold markup: it names a queue, so only A-Z a-z 0-9 . _ - (fleet.registry).
MARKUP = "[/] [link=http://x]y[/link] [bold]b"
WORKFLOW = "wf.hostile"
KEY = Secret.env("HOSTILE_KEY")

fleet = Fleet("hostile")


@fleet.step
def refuse(ctx: StepContext, why: str, key: Secret) -> None:
    raise NonRetryable(why)


@fleet.workflow(name=WORKFLOW, version="1")
def hostile(wf: WorkflowContext, why: str) -> Any:
    """Returns the secret (by name) when ``why`` is "succeed"; fails with ``why`` otherwise."""
    if why == "succeed":
        return KEY
    return wf.step(refuse, why, KEY)
