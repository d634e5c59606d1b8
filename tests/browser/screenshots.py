"""Screenshots of the console's main pages for the README. The browser tests take them on
every run, into the test's scratch folder; with FLEET_SCREENSHOTS=1 (``./dev
screenshots``) into docs/console/<page>.png, the committed images."""

from __future__ import annotations

import os
from pathlib import Path

from playwright.sync_api import Page

from tests.harness import ROOT

DOCS = ROOT / "docs" / "console"
# Read once, at import: the suite's autouse fixture clears FLEET_* from each test's environment.
WANTED = os.environ.get("FLEET_SCREENSHOTS", "") == "1"
PAGES = ("runs", "run", "inbox", "dead-letter", "fleet")


def shoot(page: Page, name: str, scratch: Path) -> Path:
    """The visible window (1280x800) as ``<name>.png``; the path written."""
    if name not in PAGES:
        raise ValueError(f"unknown screenshot {name!r}: one of {', '.join(PAGES)}")
    folder = DOCS if WANTED else scratch
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=path, full_page=False, animations="disabled", caret="hide")
    return path
