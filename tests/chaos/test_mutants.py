"""The planted bugs (tests/chaos/mutants.py) are alive: each one's patch applies to the
current tree and the patched engine imports in place of fleet; each one is killed by
its tests, run on it in a subprocess (they pass on fleet as it is, in the suite)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.chaos import mutants
from tests.chaos.mutants import Edit, Mutant, MutantError
from tests.harness import require_services

NAMES = list(mutants.MUTANTS)


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}


def test_the_seven_planted_bugs_of_issue_46_are_registered() -> None:
    assert NAMES == [
        "fence",
        "fit",
        "early-raise",
        "double-release",
        "epoch-key",
        "orphan-wake",
        "prune-live-parent",
    ]
    assert list(mutants.CAUGHT_BY_MIXED) == NAMES
    assert list(mutants.CAUGHT_BY_PROGRAMS) == NAMES
    for m in mutants.MUTANTS.values():
        assert m.doc and m.edits and m.killed_by and m.expect, m.name
        assert all(e.old != e.new for e in m.edits), m.name


@pytest.mark.parametrize("name", NAMES)
def test_the_mutant_applies_to_this_tree_and_runs_in_place_of_fleet(
    name: str, tmp_path: Path
) -> None:
    m = mutants.get(name)
    engine = mutants.materialize(name, tmp_path / "engine")
    for edit in m.edits:
        source = (engine / edit.path).read_text()
        assert edit.new in source and edit.old not in source
        compile(source, str(engine / edit.path), "exec")
    # Started outside the repository, as the chaos workers are: the copy first on the
    # PYTHONPATH wins over the editable install's finder.
    env = {**_plain_env(), "PYTHONPATH": mutants.pythonpath(engine)}
    where, planted = mutants.imported_from(env, tmp_path, *mutants.patched_modules(m))
    assert (planted, Path(where).is_relative_to(engine)) == (name, True), where


def test_without_a_mutant_the_same_process_runs_fleet_itself(tmp_path: Path) -> None:
    env = {**_plain_env(), "PYTHONPATH": mutants.pythonpath(None)}
    where, planted = mutants.imported_from(env, tmp_path)
    assert (planted, Path(where)) == ("", mutants.SOURCE / "__init__.py")


def test_a_mutant_whose_code_moved_fails_loudly_when_applied(tmp_path: Path) -> None:
    moved = Mutant("moved", "", (Edit("fleet/a.py", "x = 1\n", "x = 2\n"),), ("t",), "e")
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "a.py").write_text("y = 1\n")
    with pytest.raises(MutantError, match="0 occurrences"):
        mutants.patch(tmp_path, moved)
    (tmp_path / "fleet" / "a.py").write_text("x = 1\nx = 1\n")
    with pytest.raises(MutantError, match="2 occurrences"):
        mutants.patch(tmp_path, moved)
    with pytest.raises(MutantError, match="no mutant"):
        mutants.get("no-such-bug")


def test_the_chaos_harness_proves_its_workers_imported_the_mutant(tmp_path: Path) -> None:
    extra = mutants.engine_env("fence", tmp_path)
    assert mutants.engine_env(None, tmp_path) == {}
    where, planted = mutants.imported_from({**_plain_env(), **extra}, tmp_path)
    assert planted == "fence"
    # Each process that imported the copy named itself: engine_env's check, and this one.
    lines = (tmp_path / "mutant.log").read_text().splitlines()
    pids = [int(line.split()[0]) for line in lines]
    assert len(set(pids)) == 2 and all(line.split()[1] == "fence" for line in lines)
    mutants.prove_planted("fence", tmp_path, pids)
    with pytest.raises(MutantError, match="did not import"):
        mutants.prove_planted("fence", tmp_path, [*pids, 1])
    mutants.prove_planted(None, tmp_path, [1])


@pytest.mark.mutants
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", NAMES)
def test_the_mutant_is_killed_by_its_tests(name: str) -> None:
    m = mutants.get(name)
    if m.needs_services:
        require_services()
    done = mutants.killing_run(name)
    out = done.stdout + done.stderr
    tail = out[-4000:]
    assert f"planted bug: {name} (fleet from " in out, tail
    # Exit 1: tests ran and failed (2-5: an error, an interruption, nothing collected).
    assert done.returncode == 1, tail
    summary = [line for line in out.splitlines() if re.search(r"=+ .* in [\d.]+s", line)]
    assert summary and f" {len(m.killed_by)} failed" in summary[-1], tail
    assert "passed" not in summary[-1] and "error" not in summary[-1], tail
    assert m.expect in out, f"not killed by the expected failure ({m.expect!r}):\n{tail}"
