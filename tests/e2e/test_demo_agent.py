"""`fleet demo agent` as a newcomer runs it: a subprocess, its exit code, its proof lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_demo import run_demo
from tests.harness import ROOT, Backend


def check_story(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"SIGKILL worker-1 \(pid \d+\) while it runs call_read_note_scratch", text)
    assert "approved by 'demo'" in text
    assert "resumed" in text and "the 4 model turns before it were not asked again" in text
    # The conversation, with the step that produced each message and the compactions.
    assert re.search(r"#10 assistant · model_turn#4\n\s+There are 6 notes", text)
    assert "── compaction 2 (summarize#2): messages 0–12 summarized" in text
    assert "I deleted 'scratch'" in text
    # The proof lines, every one holding.
    assert "proof ok: model calls per turn: [1, 1, 1, 1, 1, 1, 1]" in text
    assert re.search(r"proof ok: run \w+ succeeded", text)
    assert re.search(
        r"proof ok: killed attempt taken over: call_read_note_scratch epoch 1 on worker-1 "
        r"lost, epoch 2 on worker-2 done",
        text,
    )
    assert "FAILED" not in text


def test_demo_agent(backend: Backend, tmp_path: Path) -> None:
    """On the embedded default with no flags; on Postgres + Redis with the URL flags."""
    if backend.kind == "sqlite":
        check_story(run_demo(tmp_path, "agent"))
        assert not (tmp_path / ".fleet").exists(), "without --keep the demo leaves nothing"
    else:
        flags = ("--database-url", backend.database_url, "--broker-url", backend.broker_url)
        check_story(run_demo(tmp_path, "agent", *flags))


def test_an_unknown_demo_is_refused_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="120")
    out = subprocess.run(
        [sys.executable, "-m", "fleet", "demo", "nonsense"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "no demo named 'nonsense'" in out.stderr
    assert list(tmp_path.iterdir()) == [], "nothing is started or created"
