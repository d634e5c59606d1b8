"""Planted bugs (issue 46): known bugs in a copy of the engine, to prove that the chaos
run, and the tests, would see them. Each mutant is a small source patch of ``fleet/``
(file, exact old text, new text); the old text must occur exactly once in the current
tree, so a refactor that moves the code makes the mutant fail loudly when it is applied
(``MutantError``) rather than silently become a no-op.

The mutated engine runs in place of ``fleet/``: ``fleet/`` is copied to a folder, the
patch applied there, and that folder put first on the ``PYTHONPATH`` of the processes
that are to run it (the project is installed editable: its finder comes after every
``sys.path`` entry, so the copy wins; ``engine_env`` checks it in a subprocess, and the
copy names itself, ``fleet._mutant``, in the log of every process that imports it).

- ``python -m tests.chaos --mutant NAME``: the chaos run's workers and sweeper run the
  mutant (``engine_env``, ``prove_planted``); the harness's own client and the
  fault-free reference run the engine as it is.
- ``FLEET_MUTANT=NAME pytest tests/...``: ``tests/conftest.py`` plants it in the test
  process (``plant_from_env``) and every worker or sweeper a test starts runs it too
  (``tests/harness.py``'s ``Backend.env``).
- ``tests/chaos/test_mutants.py`` applies every patch to the current tree and runs each
  mutant's killing tests on it (``killing_run``): they must fail.

Each mutant names the tests that kill it (``killed_by``: they fail on it and pass on
fleet); ``python -m tests.chaos --list-mutants`` prints them. What the chaos run with
the "mixed" workload (before the generated programs) catches, at ``--runs 100
--faults 25 --seed 1``, is in ``CAUGHT_BY_MIXED``; what the run over generated
programs catches, in ``CAUGHT_BY_PROGRAMS``.

Imports nothing of fleet (it runs before fleet is first imported, in ``tests/conftest.py``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SOURCE = ROOT / "fleet"
# The copy writes one line per process that imports it (pid, mutant, its own path) to
# the file this names, if set: the chaos harness checks its workers and sweeper did.
LOG_VARIABLE = "FLEET_MUTANT_LOG"


class MutantError(RuntimeError):
    """A mutant does not apply to this tree (its old text is gone or not unique), or a
    process that was to run it imported another engine."""


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (exactly one occurrence) with ``new`` in ``path`` (under fleet/)."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    doc: str  # what invariant it breaks and which check should catch it
    edits: tuple[Edit, ...]
    # The tests (pytest node ids) that pass on fleet and fail on this mutant, and a
    # line of the failure they must print (so an import error does not count as a kill).
    killed_by: tuple[str, ...]
    expect: str
    needs_services: bool = False  # a killing test needs Postgres and Redis

    @property
    def where(self) -> str:
        return ", ".join(sorted({e.path for e in self.edits}))

    @property
    def summary(self) -> str:
        return " ".join(self.doc.strip().split("\n\n")[0].split())


MUTANTS: dict[str, Mutant] = {}


def mutant(
    *killed_by: str, expect: str, needs_services: bool = False
) -> Callable[[Callable[[], list[Edit]]], Callable[[], list[Edit]]]:
    """Register the function's edits as a mutant named after it (``_`` → ``-``); its
    docstring says what it breaks and what should catch it."""

    def register(fn: Callable[[], list[Edit]]) -> Callable[[], list[Edit]]:
        name = fn.__name__.replace("_", "-")
        MUTANTS[name] = Mutant(
            name, fn.__doc__ or "", tuple(fn()), tuple(killed_by), expect, needs_services
        )
        return fn

    return register


# --- the mutants ------------------------------------------------------------------------


@mutant(
    "tests/integration/test_crash_and_fence.py::test_frozen_worker_is_fenced_when_it_wakes[sqlite]",
    expect="the workflow saw the epoch-2 attempt's output",
)
def fence() -> list[Edit]:
    """The epoch dropped from the commit fence: ``commit_output`` applies while the step
    is running, whoever holds it, so a zombie (an attempt frozen past its lease and
    taken over) commits its output and the attempt holding the lease is fenced instead.

    Breaks invariant 3 (a write lands only under the epoch held). Caught by the chaos
    report's zombie check (a frozen attempt taken over whose outcome is ``done``:
    ``zombies_through``), and by ``fenced_writes < stale_expected_fenced``."""
    return [
        Edit(
            "fleet/store/transitions.py",
            'COMMIT = (\n    _fenced("commit_output")\n',
            'COMMIT = (\n    _move("commit_output").where(held(RUN, STEP, steps.c.epoch))\n',
        )
    ]


@mutant(
    "tests/integration/test_live_runs.py::"
    "test_a_parked_workflow_is_resumed_only_for_its_own_run[sqlite]",
    expect="RunFailed: run twin failed",
)
def fit() -> list[Edit]:
    """A live run resumed without its fit check (``Live.fits``): a parked workflow is
    resumed for any advance of a run of its id on its thread, even if that is another
    run (another store's, or the id enqueued again after retention deleted the run), a
    history without the positions it parked on, or another registry.

    Breaks live.py's rule that a resumed workflow does what a replay from the top over
    the same history would. Caught by a run whose result or end differs from the model
    (the chaos run's ``differing``/``lost``), and by replaying a captured history."""
    return [Edit("fleet/worker/live.py", "            or not live.fits(rt, run, history)\n", "")]


@mutant(
    "tests/integration/test_fanout.py::"
    "test_a_replay_meeting_a_dead_branch_beside_pending_ones_parks_again[sqlite]",
    expect="the fan-out raised with branches still pending",
)
def early_raise() -> list[Edit]:
    """A fan-out (``wf.map``, ``wf.parallel``) that raises its first dead branch as soon
    as a replay sees it, while siblings are still pending or running. The store wakes a
    run only when the last branch of a fan-out settles, so this shows when the run is
    replayed for another reason meanwhile: a signal, a timer, a lost advance re-sent,
    a worker's crash recovery, a console action.

    Breaks invariant 11 (a fan-out settles before it raises; nothing of it runs on
    behind a finished run). Caught by "no step or child left pending behind a finished
    parent", and by a run ending otherwise than the model says (a caught failure
    returns before the siblings' effects)."""
    return [
        Edit(
            "fleet/worker/fanout.py",
            "        while new or any(rec is None or not rec.status.finished for rec in recs):\n"
            "            recs, new = self._park(start, ids), []\n",
            "        while new or any(rec is None or not rec.status.finished for rec in recs):\n"
            "            for i, rec in enumerate(recs):  # planted: the first dead one raises\n"
            "                if rec is not None and rec.status == 'dead' and not return_exceptions:"
            "\n"
            "                    self._outcome(rec, start + i, ids[i])\n"
            "            recs, new = self._park(start, ids), []\n",
        )
    ]


@mutant(
    "tests/integration/test_limits_store.py::"
    "test_a_released_slot_is_free_again_and_only_its_holder_releases_it[sqlite]",
    "tests/integration/test_limits_store.py::"
    "test_a_released_slot_is_free_again_and_only_its_holder_releases_it[redis]",
    expect="isinstance(None, Throttled)",
    needs_services=True,
)
def double_release() -> list[Edit]:
    """A limit that releases a slot twice. A slot is held by a step's delivery under a
    token, and a release gives back only a slot its token holds, so a second release
    of the same slot is a no-op. Planted: the release skips the token (the store's and
    Redis's limiter both), so a late second release (an attempt frozen past its lease:
    its slot lapsed and the step's next attempt took it again under a new token) frees
    the slot its successor now holds, and one more step of the limit gets in.

    Breaks "a concurrency limit is never exceeded". Caught by the provider-side overlap
    count per limit (programs' ``enter``/``exit`` log, FLEET_CHAOS_LIMIT_LOG) under
    freezes of steps that name a limit."""
    return [
        Edit(
            "fleet/store/limits.py",
            "_RELEASE = delete(limit_slots).where(\n"
            "    limit_slots.c.limit_key.in_(KEYS),\n"
            "    limit_slots.c.run_id == RUN,\n"
            "    limit_slots.c.step_id == STEP,\n"
            "    limit_slots.c.token == TOKEN,\n"
            ")\n",
            "_RELEASE = delete(limit_slots).where(\n"
            "    limit_slots.c.limit_key.in_(KEYS),\n"
            "    limit_slots.c.run_id == RUN,\n"
            "    limit_slots.c.step_id == STEP,\n"
            "    (limit_slots.c.token == TOKEN) | (limit_slots.c.token != TOKEN),  # planted\n"
            ")\n",
        ),
        Edit(
            "fleet/worker/limiter.py",
            "  if mine(key, holder, token) then\n    redis.call('ZREM', k(key, 'slots'), holder)\n",
            "  if redis.call('ZSCORE', k(key, 'slots'), holder) then\n"
            "    redis.call('ZREM', k(key, 'slots'), holder)\n",
        ),
    ]


@mutant(
    "tests/integration/test_effects.py::"
    "test_idempotent_effect_is_retried_with_the_same_key[sqlite]",
    expect="applied once",
)
def epoch_key() -> list[Edit]:
    """An effect's idempotency key that includes the epoch: each attempt of an effect
    step calls the provider under a key of its own, so an attempt retried after its
    worker died past the call applies the effect a second time.

    Breaks invariant 5 (effects at least once, made effectively once by the key).
    Caught by the provider's count of applications per effect (``applied_twice``) and
    by the recorded effect not being the one applied under the step's key
    (``effect_mismatch``)."""
    return [
        Edit(
            "fleet/worker/context.py",
            'self.idempotency_key = f"{lease.run_id}:{lease.step_id}"\n',
            'self.idempotency_key = f"{lease.run_id}:{lease.step_id}:{lease.epoch}"\n',
        )
    ]


@mutant(
    "tests/integration/test_children.py::"
    "test_a_childs_end_wakes_its_parent_in_the_store_for_the_sweeper[sqlite]",
    expect="the sweeper to re-send the parent's advance",
)
def orphan_wake() -> list[Edit]:
    """A child's end that does not wake its parent: the parent's child step takes the
    child's outcome, but the parent is not marked woken in the store. Only the advance
    message the child's last replay sends moves the parent on; when the broker loses
    it (a flush, a restart, a worker killed between its commit and its send), the
    sweeper has nothing to re-send and the parent waits forever on a settled child.

    Breaks "the broker is a hint: every wake-up is in the store". Caught by runs that
    never end (``lost``) once messages are lost while children end."""
    return [
        Edit(
            "fleet/store/family.py",
            "        if settled.rowcount == 1 and self._branch_settled(conn, *key.values()):\n"
            "            self._wake(conn, parent.parent_id)\n",
            "        if settled.rowcount == 1 and self._branch_settled(conn, *key.values()):\n"
            "            pass  # planted: the parent is not woken\n",
        )
    ]


@mutant(
    "tests/integration/test_retention.py::"
    "test_a_live_parent_keeps_its_finished_child_and_its_budget_counts_the_childs_spend[sqlite]",
    expect="= prune(1, dry_run=True)",
)
def prune_live_parent() -> list[Edit]:
    """Prune that ignores a live parent: every finished run heads a tree of its own,
    so a finished child (and its own finished descendants) is deleted while its parent
    is still live; the parent's budget stops counting the child's spend, its
    ``wf.child`` handle and ``fleet status`` lose it.

    Breaks invariant 15 (retention never changes a live run's story). Caught by a
    checker that finds a run's child gone or its spend changed while the run is live
    (prune and the sweeper's retention running throughout), and by a live parent that
    later reads its child's result."""
    return [
        Edit(
            "fleet/store/pruning.py",
            "        .where(prunable(cutoff), is_root(), runs.c.id > after)\n",
            "        .where(prunable(cutoff), runs.c.id > after)  # planted: each run a root\n",
        )
    ]


# What the chaos run with today's workload (the one "mixed" workflow: a chain, a map, a
# retried step, an effect; no children, limits, failing branches, signals or prune)
# caught, at ``--runs 100 --faults 25 --seed 1`` on this 2-core machine (the run's own
# seconds; the check is at the end of the run, so that is the time to catch).
CAUGHT_BY_MIXED = {
    "fence": "caught in 110 s: a frozen attempt's write got through the fence",
    "fit": "not caught (95 s): no advance of a parked run met another history",
    "early-raise": "not caught (111 s): no branch of the workload fails",
    "double-release": "not caught (99 s): no step of the workload names a limit",
    "epoch-key": "caught in 109 s: every run's recorded effect is not the provider's",
    "orphan-wake": "not caught (118 s): the workload starts no child run",
    "prune-live-parent": "not caught (66 s): nothing prunes during the run",
}

# What the chaos run over generated programs (``--programs``, tests/chaos/program_chaos.py)
# caught on 2026-12-07, on this 2-core machine (the run's own seconds), at
# ``--programs 100 --faults 25`` (seeds 16, 18) and ``--programs 200 --faults 40``
# (seed 19); ``make chaos`` runs 1,000 programs (every catch here is well inside it).
# A catch depends on a fault meeting the bug's moment, so a seed may miss what another
# catches.
CAUGHT_BY_PROGRAMS = {
    "fence": "caught in 75 s (seed 18): a frozen attempt's write got through the fence",
    "fit": "caught in 76 s (seed 16) and 140 s (seed 19; not by seed 18): a rerun under "
    "a pruned root id resumed its predecessor's parked workflow (wrong result)",
    "early-raise": "caught in 75 s and 76 s (seeds 16, 18): a run ended with a branch "
    "left going (settled check) and a replay that disagrees",
    "double-release": "caught in 270 s (seed 19, 200 programs: the limit overlapped twice) "
    "once the limit is of concurrency 1, a later attempt holds its slot 2 s longer and "
    "the freeze waits for a caught slot holder's takeover; not caught before that "
    "(seeds 18, 19)",
    "epoch-key": "caught in 67 s (seed 18): effects applied under keys no run expects",
    "orphan-wake": "caught by a run of 588 s (seed 19; 480 s of it the settle waits for "
    "runs still live): 20 parents never woken after their children ended; not by seed 18",
    "prune-live-parent": "caught in 117 s (seed 19): children pruned under live parents "
    "(runs missing from their trees)",
}


# --- applying one -----------------------------------------------------------------------


def get(name: str) -> Mutant:
    if name not in MUTANTS:
        raise MutantError(f"no mutant {name!r}; one of: {', '.join(MUTANTS)}")
    return MUTANTS[name]


def patch(tree: Path, m: Mutant) -> None:
    """Apply ``m``'s edits to the copy of the repository's files under ``tree`` (which
    holds ``fleet/``). Each old text must occur exactly once."""
    for edit in m.edits:
        path = tree / edit.path
        text = path.read_text()
        found = text.count(edit.old)
        if found != 1:
            raise MutantError(
                f"mutant {m.name}: {edit.path} has {found} occurrences of the text to "
                f"replace (1 expected); the code moved, update the mutant:\n{edit.old}"
            )
        path.write_text(text.replace(edit.old, edit.new))


def _marker(name: str) -> str:
    return (
        f'"""This copy of fleet has a planted bug, {name!r} (tests/chaos/mutants.py)."""\n\n'
        "import os\n\n"
        f"NAME = {name!r}\n"
        f"_log = os.environ.get({LOG_VARIABLE!r})\n"
        "if _log:\n"
        '    with open(_log, "a") as _f:\n'
        '        _f.write(f"{os.getpid()} {NAME} {__file__}\\n")\n'
    )


def materialize(name: str, dest: Path) -> Path:
    """``dest/fleet``: a copy of ``fleet/`` with the mutant ``name`` applied, and a
    module ``fleet._mutant`` naming it (imported by the copy's ``fleet/__init__``).
    Returns ``dest``, the folder to put first on the PYTHONPATH."""
    m = get(name)
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / "fleet"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(SOURCE, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    patch(dest, m)
    (target / "_mutant.py").write_text(_marker(name))
    with (target / "__init__.py").open("a") as f:
        f.write("\nfrom fleet import _mutant as _mutant  # noqa: E402  (a planted bug)\n")
    return dest


def pythonpath(engine: Path | None) -> str:
    """The PYTHONPATH of a process that runs ``engine`` (a ``materialize`` folder; None:
    fleet as it is), with the repository (tests/, the workflows) after it."""
    return os.pathsep.join([*([str(engine)] if engine else []), str(ROOT)])


def imported_from(env: dict[str, str], cwd: Path, *modules: str) -> tuple[str, str]:
    """Where a Python process with ``env`` started in ``cwd`` imports ``fleet`` from,
    and the planted mutant's name ("" if none): one short subprocess. ``modules``: more
    of fleet's modules it imports too (a patched module must import)."""
    code = (
        "import importlib, fleet\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        "print(fleet.__file__)\n"
        "print(getattr(getattr(fleet, '_mutant', None), 'NAME', ''))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise MutantError(f"importing the engine failed:\n{done.stderr[-3000:]}")
    where, name = (done.stdout.splitlines() + ["", ""])[:2]
    return where, name


def patched_modules(m: Mutant) -> list[str]:
    """The dotted names of the modules ``m`` patches."""
    return sorted({e.path.removesuffix(".py").replace("/", ".") for e in m.edits})


# --- the chaos harness's side -------------------------------------------------------------


def engine_env(name: str | None, workdir: Path) -> dict[str, str]:
    """What the chaos harness adds to its workers' and sweeper's environment to run the
    mutant ``name`` (nothing for None): the copy first on the PYTHONPATH, and the log
    each of them names itself in. Checked here first: a process with this environment,
    started where the workers start, imports the copy."""
    if name is None:
        return {}
    m = get(name)
    engine = materialize(name, workdir / f"engine-{name}")
    extra = {"PYTHONPATH": pythonpath(engine), LOG_VARIABLE: str(workdir / "mutant.log")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    where, planted = imported_from({**env, **extra}, workdir, *patched_modules(m))
    if planted != name or not Path(where).is_relative_to(engine):
        raise MutantError(f"a worker would import fleet from {where} (planted: {planted!r})")
    return extra


def prove_planted(name: str | None, workdir: Path, pids: list[int]) -> None:
    """Every one of ``pids`` (the workers and the sweeper) imported the mutant's copy:
    each wrote its line to the log (``engine_env``). Nothing to prove for None."""
    if name is None:
        return
    log = workdir / "mutant.log"
    lines = log.read_text().splitlines() if log.exists() else []
    seen = {int(line.split()[0]) for line in lines if line.split()[1:2] == [name]}
    missing = sorted(set(pids) - seen)
    if missing:
        raise MutantError(f"processes {missing} did not import the mutant {name!r} ({log})")


# --- the tests' side ------------------------------------------------------------------------

_planted: list[str] = []


def plant_from_env() -> None:
    """With FLEET_MUTANT=NAME, put the mutant's copy of fleet first on this process's
    ``sys.path`` (before anything imports fleet), and ``planted()`` names it for the
    workers and sweepers the tests start. Called by ``tests/conftest.py``."""
    name = os.environ.get("FLEET_MUTANT")
    if not name or _planted:
        return
    if "fleet" in sys.modules:
        raise MutantError(f"FLEET_MUTANT={name}: fleet was imported before it could be planted")
    engine = materialize(name, Path(tempfile.mkdtemp(prefix=f"fleet-mutant-{name}-")))
    atexit.register(shutil.rmtree, engine, True)
    sys.path.insert(0, str(engine))
    _planted.append(str(engine))
    os.environ["PYTHONPATH"] = pythonpath(engine)


def planted() -> list[str]:
    """The folder of the mutant this process planted, as a PYTHONPATH entry ([] if none)."""
    return list(_planted)


def header() -> str | None:
    """pytest's report header line naming the planted mutant, if any."""
    if not _planted:
        return None
    import fleet

    return f"planted bug: {os.environ.get('FLEET_MUTANT')} (fleet from {fleet.__file__})"


def killing_run(name: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Run the mutant's killing tests on it: pytest in a subprocess with FLEET_MUTANT."""
    m = get(name)
    # PYTEST_XDIST_WORKER, if set, is kept: the Redis database is the calling worker's.
    env = {**os.environ, "FLEET_MUTANT": name}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *m.killed_by]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def table() -> str:
    """The mutants, one per line: name, where, what it breaks, what kills it."""
    lines = []
    for m in MUTANTS.values():
        lines.append(f"{m.name:18} {m.where}")
        lines.append(f"{'':18} {m.summary}")
        for test in m.killed_by:
            lines.append(f"{'':18} killed by {test}")
        lines.append(f"{'':18} chaos (mixed): {CAUGHT_BY_MIXED.get(m.name, 'not run')}")
        lines.append(f"{'':18} chaos (programs): {CAUGHT_BY_PROGRAMS.get(m.name, 'not run')}")
    return "\n".join(lines)
