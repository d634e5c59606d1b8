"""Benchmark 7 (issue #15): what a transcript costs. Three loops of N model turns, each
turn one step returning a ~2 KB assistant message followed by a short user message
(``bench/transcript_flows.py``), run in this process on a fresh SQLite file with
``fleet.testing.InlineBroker`` (no broker, no worker):

* quadratic: the growing ``messages`` list is each step's input (today's natural loop;
  quadratic in store bytes, so only at 50, 100 and 200 turns);
* transcript: ``chat = wf.transcript()``; each turn ``wf.step(model_turn, chat.window())``
  then ``chat.append(reply)``;
* nothing: the same steps given nothing, appending nowhere (the floor).

For each it prints the raw message bytes (the JSON size of every message the loop
produced), the bytes recorded (``fleet_steps.input`` + ``output``, ``fleet_messages.body``,
``fleet_blobs.body``), the store file after ``PRAGMA wal_checkpoint(TRUNCATE)`` and the
ratio store/raw; and, for transcript against nothing, the time per turn (one ``execute``
delivery: lease, body, commit and the replay that records the next step) averaged over
the 20 turns before N, in wall time and in this thread's CPU time (the figure to compare
on a machine shared with other work, which inflates wall time far more). Then the SQL
statements a step runs while it reads a 1,000-message window: first in a fresh cache,
then over the window grown by a few messages, then over the same window again. With
``--replay``, the replay alone (a finished loop's workflow run over its whole recorded
history, the least of ``--reps`` times): the O(turns) part of every advance, without
the per-turn constants (lease, commit) or the noise of a 20-turn average.

    .venv/bin/python -m bench.transcripts [--turns 100,1000,5000] [--quadratic 50,100,200]
                                          [--window 1000] [--profile N] [--tail 20]
                                          [--replay 1000,2000 --reps 15]

A measurement, never a test: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import sqlite3
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import event

from bench import transcript_flows as flows
from bench.common import save
from fleet import Fleet, Settings, codec
from fleet.testing import InlineBroker
from fleet.worker.dispatch import EXECUTE
from fleet.worker.workflow import WorkflowContext

TAIL = 20  # turns averaged before N
TARGET_RATIO, TARGET_SLOWDOWN = 3.0, 1.5


@dataclass
class Storage:
    """One loop of ``turns`` turns: its bytes, its store, how long it took."""

    variant: str
    turns: int
    raw_bytes: int
    recorded_bytes: int
    blob_bytes: int
    store_bytes: int
    seconds: float
    turn_ms: float  # mean wall time of the TAIL turns before the last
    body_read_ms: float  # of which the step body reading what it was given
    turn_cpu_ms: float  # the same turns in this thread's CPU time
    body_read_cpu_ms: float
    store_16k: int  # the same store copied to 16 KiB pages (a what-if, not fleet's)
    store_ref: int  # replies stored once, messages referring to the step's output

    @property
    def ratio(self) -> float:
        return self.store_bytes / self.raw_bytes


def raw_bytes(turns: int) -> int:
    """The JSON size of every message a loop of ``turns`` turns produces."""
    msgs = [flows.FIRST]
    for turn in range(1, turns + 1):
        msgs += [flows.reply(turn), flows.user(turn)]
    return sum(len(codec.encode(m, what="message", limit=1 << 30).encode()) for m in msgs)


def bound(path: Path) -> Fleet:
    fleet = flows.fleet.with_settings(Settings(database_url=f"sqlite:///{path}"))
    fleet.upgrade_schema()
    return fleet


def drive(broker: InlineBroker) -> tuple[list[float], list[float]]:
    """Deliver every message; the wall and CPU seconds (this thread's: a sync step body
    runs in it) of each ``execute`` delivery (one turn: lease, body, commit and the
    replay recording the next turn), in order."""
    times: list[float] = []
    cpu: list[float] = []
    limit = 4 * 10**6
    for _ in range(limit):
        if not broker.sent:
            return times, cpu
        task = broker.sent[0][0]
        t0, c0 = time.perf_counter(), time.thread_time()
        broker.step()
        if task == EXECUTE:
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    raise AssertionError(f"messages kept coming: {limit} delivered")


def store_bytes(path: Path) -> tuple[int, int, int]:
    """(bytes recorded in steps and messages, bytes in blobs, file size) of a store."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (steps,) = conn.execute(
            "SELECT COALESCE(SUM(LENGTH(input) + COALESCE(LENGTH(output), 0)), 0) FROM fleet_steps"
        ).fetchone()
        (msgs,) = conn.execute(
            "SELECT COALESCE(SUM(LENGTH(body)), 0) FROM fleet_messages"
        ).fetchone()
        (blobs,) = conn.execute("SELECT COALESCE(SUM(LENGTH(body)), 0) FROM fleet_blobs").fetchone()
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    return int(steps) + int(msgs), int(blobs), int(pages) * int(size)


def repacked(path: Path, page_size: int = 4096, by_reference: bool = False) -> int:
    """What-ifs, not fleet's: the size of a copy of the store rebuilt with ``page_size``
    pages (a ~2 KB row fills more than half a 4 KiB page, so each takes a page of its
    own) and, with ``by_reference``, each message that is a step's output stored as a
    reference to that output (``step:<id>``) instead of a second copy."""
    copy = path.with_suffix(f".{page_size}{'.ref' if by_reference else ''}.db")
    shutil.copyfile(path, copy)
    conn = sqlite3.connect(copy)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute(f"PRAGMA page_size={page_size}")
        if by_reference:
            conn.execute(
                "UPDATE fleet_messages SET body = 'step:' || step_id WHERE step_id IS NOT NULL"
            )
            conn.commit()
        conn.execute("VACUUM")
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    finally:
        conn.close()
    copy.unlink()
    return int(pages) * int(size)


def measure(variant: str, turns: int, workdir: Path, tail: int = TAIL) -> Storage:
    """One loop of ``turns`` turns on a fresh SQLite file; times averaged over the
    ``tail`` turns before the last (a longer tail averages out the collector's full
    passes, each ~0.1 s, which a 20-turn tail catches or misses by chance)."""
    path = workdir / f"{variant}-{turns}.db"
    fleet = bound(path)
    broker = InlineBroker(fleet)
    flows.BODY_READ_SECONDS.clear()
    flows.BODY_READ_CPU.clear()
    t0 = time.perf_counter()
    run = fleet.enqueue(variant, turns)
    times, cpu = drive(broker)
    seconds = time.perf_counter() - t0
    result = run.wait(timeout=0)
    assert result >= turns, result
    assert len(times) == turns, (len(times), turns)
    recorded, blobs, size = store_bytes(path)
    wall_tail = times[-tail - 1 : -1] or times
    reads = flows.BODY_READ_SECONDS[-tail - 1 : -1] or flows.BODY_READ_SECONDS
    cpu_tail = cpu[-tail - 1 : -1] or cpu
    cpu_reads = flows.BODY_READ_CPU[-tail - 1 : -1] or flows.BODY_READ_CPU
    fleet.runtime.db.engine.dispose()
    return Storage(
        variant,
        turns,
        raw_bytes(turns),
        recorded,
        blobs,
        size,
        seconds,
        1000 * statistics.mean(wall_tail),
        1000 * statistics.mean(reads),
        1000 * statistics.mean(cpu_tail),
        1000 * statistics.mean(cpu_reads),
        repacked(path, 16384),
        repacked(path, by_reference=True),
    )


def profiled(variant: str, turns: int, workdir: Path, top: int) -> str:
    """cProfile of the last TAIL turns of one loop: the ``top`` functions by own time."""
    path = workdir / f"profile-{variant}-{turns}.db"
    fleet = bound(path)
    broker = InlineBroker(fleet)
    fleet.enqueue(variant, turns)
    # Unprofiled until TAIL turns before the end, then profiled.
    executed = 0
    prof = cProfile.Profile()
    for _ in range(4 * turns + 10):
        if not broker.sent:
            break
        on = broker.sent[0][0] == EXECUTE and executed >= turns - TAIL
        if on:
            prof.enable()
        task = broker.sent[0][0]
        broker.step()
        if on:
            prof.disable()
        executed += task == EXECUTE
    else:
        raise AssertionError(f"{variant} at {turns} turns did not settle")
    fleet.runtime.db.engine.dispose()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def replays(turns: int, workdir: Path, reps: int) -> dict[str, float]:
    """The replay alone, per loop: run to ``turns`` turns, then its workflow replayed in
    full over the recorded history ``reps`` times (what each advance does before it
    records the next step; here nothing is left to record), the two loops alternating.
    The least of each loop's times, in this thread's CPU seconds."""
    done: dict[str, tuple[Any, Any, Any]] = {}
    for variant in ("transcript", "nothing"):
        fleet = bound(workdir / f"replay-{variant}-{turns}.db")
        broker = InlineBroker(fleet)
        run = fleet.enqueue(variant, turns)
        drive(broker)
        snapshot = fleet.runtime.queries.snapshot(run.id)
        assert snapshot is not None
        done[variant] = (fleet, fleet.runtime.registry.workflows[variant], snapshot)
    best = {variant: float("inf") for variant in done}
    for _ in range(reps):
        for variant, (fleet, wf, (row, history)) in done.items():
            c0 = time.thread_time()
            assert wf.fn(WorkflowContext(fleet.runtime, row, history), turns) >= turns
            best[variant] = min(best[variant], time.thread_time() - c0)
    for fleet, _, _ in done.values():
        fleet.runtime.db.engine.dispose()
    return best


def statements(size: int, more: int, workdir: Path) -> list[dict[str, Any]]:
    """The probe workflow: statements and cache reads of each probe step's body."""
    fleet = bound(workdir / f"window-{size}.db")
    broker = InlineBroker(fleet)
    flows.PROBES.clear()
    flows.CACHE = fleet.runtime.db.messages

    @event.listens_for(fleet.runtime.db.engine, "before_cursor_execute")
    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if flows.COUNTING:
            flows.STATEMENTS[0] += 1
            flows.STATEMENTS[1] += statement.lstrip().upper().startswith("SELECT")

    run = fleet.enqueue("window_reads", size, more)
    for _ in range(100):
        if not broker.sent:
            break
        task, args = broker.sent[0]
        if task == EXECUTE and args[1] == "first":
            # The first read as a process that never read this transcript makes it.
            fleet.runtime.db.messages.clear()
        broker.step()
    print(f"  window_reads result: {run.wait(timeout=0)}")
    fleet.runtime.db.engine.dispose()
    return list(flows.PROBES)


def table(rows: list[Storage], tail: int = TAIL) -> str:
    lines = [
        "| loop | turns | raw message bytes | recorded (steps+messages) | blobs | store file "
        "| store/raw | if 16 KiB pages | if replies by reference | run s "
        f"| ms/turn (last {tail}) | of which body reads | CPU ms/turn | of which body reads |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.turns:,} | {r.raw_bytes / 1e3:,.0f} KB "
            f"| {r.recorded_bytes / 1e6:,.2f} MB | {r.blob_bytes / 1e6:,.2f} MB "
            f"| {r.store_bytes / 1e6:,.2f} MB | {r.ratio:.2f}× "
            f"| {r.store_16k / r.raw_bytes:.2f}× | {r.store_ref / r.raw_bytes:.2f}× "
            f"| {r.seconds:,.1f} "
            f"| {r.turn_ms:.2f} | {r.body_read_ms:.2f} "
            f"| {r.turn_cpu_ms:.2f} | {r.body_read_cpu_ms:.2f} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", default="100,1000,5000", help="transcript and nothing loops")
    ap.add_argument("--quadratic", default="50,100,200", help="quadratic loops (keep small)")
    ap.add_argument("--window", type=int, default=1000, help="messages the probe reads")
    ap.add_argument("--more", type=int, default=5, help="messages added before the 2nd probe")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the transcript loop at N")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--tail", type=int, default=TAIL, help="turns averaged before N")
    ap.add_argument("--replay", default="", help="time the replay alone at these turns")
    ap.add_argument("--reps", type=int, default=15, help="replays timed (the least is kept)")
    args = ap.parse_args()

    rows: list[Storage] = []
    with tempfile.TemporaryDirectory(prefix="fleet-bench-transcripts-") as tmp:
        workdir = Path(tmp)
        plan = [("quadratic", n) for n in _ints(args.quadratic)]
        for n in _ints(args.turns):
            plan += [("transcript", n), ("nothing", n)]
        for variant, n in plan:
            row = measure(variant, n, workdir, args.tail)
            rows.append(row)
            print(
                f"{variant:>10} {n:>6,} turns: store {row.store_bytes / 1e6:.2f} MB "
                f"({row.ratio:.2f}× raw), {row.seconds:.1f} s, {row.turn_ms:.2f} ms/turn "
                f"({row.turn_cpu_ms:.2f} CPU)",
                flush=True,
            )
        print()
        print(table(rows, args.tail))
        slow: dict[int, float] = {}
        slow_cpu: dict[int, float] = {}
        by = {(r.variant, r.turns): r for r in rows}
        for n in _ints(args.turns):
            b, c = by[("transcript", n)], by[("nothing", n)]
            slow[n] = b.turn_ms / c.turn_ms
            print(
                f"turn {n:,}: transcript {b.turn_ms:.2f} ms vs nothing {c.turn_ms:.2f} ms "
                f"= {slow[n]:.2f}× (target ≤ {TARGET_SLOWDOWN}×); without the body's read: "
                f"{(b.turn_ms - b.body_read_ms) / c.turn_ms:.2f}×"
            )
            slow_cpu[n] = (b.turn_cpu_ms - b.body_read_cpu_ms) / c.turn_cpu_ms
            print(
                f"turn {n:,} in CPU time: transcript {b.turn_cpu_ms:.2f} ms vs nothing "
                f"{c.turn_cpu_ms:.2f} ms = {b.turn_cpu_ms / c.turn_cpu_ms:.2f}×; without the "
                f"body's read ({b.body_read_cpu_ms:.2f} ms): {slow_cpu[n]:.2f}×"
            )
        probes = statements(args.window, args.more, workdir)
        print("\nstatements while a step reads its window:")
        for p in probes:
            print(f"  {p}")
        replayed: dict[str, dict[str, float]] = {}
        for n in _ints(args.replay):
            best = replayed[str(n)] = replays(n, workdir, args.reps)
            print(
                f"replay of all {n:,} turns (least of {args.reps}, CPU): transcript "
                f"{1000 * best['transcript']:.2f} ms vs nothing {1000 * best['nothing']:.2f} ms "
                f"= {best['transcript'] / best['nothing']:.2f}×"
            )
        profile = ""
        if args.profile:
            profile = profiled("transcript", args.profile, workdir, args.top)
            print(f"\ncProfile, last {TAIL} turns of transcript at {args.profile}:\n{profile}")
    path = save(
        "transcripts",
        {
            "storage": [{**asdict(r), "ratio": r.ratio} for r in rows],
            "slowdown": {str(k): v for k, v in slow.items()},
            "slowdown_cpu_without_read": {str(k): v for k, v in slow_cpu.items()},
            "statements": probes,
            "replay_seconds": replayed,
            "profile": profile,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
