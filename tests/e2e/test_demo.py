"""`fleet demo` as a newcomer runs it: a subprocess, its exit code and its summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.harness import ROOT, Backend


def run_demo(cwd: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="120")
    return subprocess.run(
        [sys.executable, "-m", "fleet", "demo", *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def check_story(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "SIGKILL worker-" in text and "while it runs critique#2" in text
    assert re.search(r"resumed.*took over critique#2 at epoch 2", text)
    assert re.search(r"critique#2\s*│\s*2\s*│\s*worker-\d \(lost\), worker-\d\s*│\s*2", text)
    # Only the killed step ran again; a restart from step one would have re-run eight.
    assert re.search(r"re-run after the crash \(fleet\)\s*│\s*1\s*│", text)
    assert re.search(r"restarting from step one would re-run\s*│\s*8\s*│", text)
    assert "succeeded" in text and "Report: durable execution" in text
    # Piped, the live view's last line used to run into the next table's title.
    assert re.search(r"^\s*every step\s*$", text, re.M), text


def test_demo(backend: Backend, tmp_path: Path) -> None:
    """On the embedded default with no flags; on Postgres + Redis with the URL flags."""
    if backend.kind == "sqlite":
        check_story(run_demo(tmp_path))
        assert not (tmp_path / ".fleet").exists(), "without --keep the demo leaves nothing"
    else:
        check_story(
            run_demo(
                tmp_path, "--database-url", backend.database_url, "--broker-url", backend.broker_url
            )
        )


def test_demo_keep_leaves_state_for_the_cli(tmp_path: Path) -> None:
    out = run_demo(tmp_path, "--keep")
    check_story(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    runs = subprocess.run(
        [sys.executable, "-m", "fleet", "runs"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert runs.returncode == 0 and "research_deep" in runs.stdout and "succeeded" in runs.stdout


def test_demo_without_the_example_agents_says_so_in_one_line(tmp_path: Path) -> None:
    """The library does not depend on ``tasks``: the demo loads it by name and, when it
    cannot, says why and starts nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="120")
    blocked = "import sys; sys.modules['tasks'] = None; from fleet.ops.cli import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", blocked, "demo"],
        cwd=tmp_path,
        env={**env, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "'tasks' package" in out.stderr
    assert "fleet demo" not in out.stdout, "nothing is shown before the examples are found"
    assert list(tmp_path.iterdir()) == [], "nothing is created either"
