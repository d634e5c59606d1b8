"""The program workload's rules on hand-made records (no services): which dead steps
died of faults, which killed run the console replays, how a console decision reads as
the signal's value, how a rerun's program and effects are told from the first one's, the
limit overlaps excused after a flush, re-executions and the recovery quantiles, the
driver forgetting a root id, the embedded default's faults, and the proxy's cut."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import pytest

from tests.chaos import programs as P
from tests.chaos.console_hands import _error_line
from tests.chaos.driver import Driver
from tests.chaos.faults import FLUSHALL, KILL, PG_RESTART, Fault
from tests.chaos.harness import EMBEDDED_KINDS, ChaosConfig
from tests.chaos.program_chaos import (
    RESTORE_GAP,
    _mine,
    _overlap,
    died_of_faults,
    history,
    replayable,
    rerun_program,
)
from tests.chaos.proxy import Proxy
from tests.chaos.report import Report, _interrupted_starts, _quantile, _recoveries
from tests.chaos.services import EmbeddedBroker


def _try(outcome: str, error: str | None = None, epoch: int = 1) -> dict[str, Any]:
    return {"epoch": epoch, "attempt": epoch, "outcome": outcome, "worker": "w", "error": error}


def _cap(run: str, *steps: tuple[str, str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "run": run,
        "status": "failed",
        "result": None,
        "error": "StepFailed: x",
        "steps": [
            {"id": sid, "kind": "task", "status": status, "tries": tries}
            for sid, status, tries in steps
        ],
    }


def test_a_dead_step_died_of_faults_only_if_an_attempt_was_not_its_programs_own_failure():
    own = [_try("failed", "ValueError: boom o3", 1), _try("failed", "ValueError: boom o3", 2)]
    lost = [_try("lost", None, 1), _try("failed", "RuntimeError: flaky o4", 2)]
    cut = [_try("failed", "StoreUnavailable: store unavailable", 1)]
    fenced = [_try("fenced", None, 1), _try("failed", "NonRetryable: refused o6", 2)]
    done_after_loss = [_try("lost", None, 1), _try("done", None, 2)]
    caps = [
        _cap(
            "r",
            ("o3", "dead", own),
            ("o4", "dead", lost),
            ("o5", "dead", cut),
            ("o6", "dead", fenced),
            ("o7", "done", done_after_loss),
        ),
        _cap("r/o8", ("o9", "dead", [])),  # a child step: no attempts of its own
    ]
    assert died_of_faults(caps) == {("r", "o4"), ("r", "o5"), ("r", "o6")}
    text = history(caps)
    assert "run r failed: StepFailed: x" in text and "o4 task dead [1:lost@w 2:failed@w]" in text


def test_a_rerun_is_another_program_whose_ids_and_effect_keys_are_its_own():
    first = P.generate(5, 8)
    again = rerun_program(5, 8)
    assert again == rerun_program(5, 8)  # reproducible
    assert all(op["id"].startswith("ro") for op in P.walk(again))
    assert {op["id"] for op in P.walk(again)}.isdisjoint(op["id"] for op in P.walk(first))
    applied = {"cp-5-8:o3": 1, "cp-5-8/o4:o6#1": 1, "cp-5-8:ro3": 1, "cp-5-8/ro4:ro6": 1}
    assert _mine(applied, rerun=False) == {"cp-5-8:o3": 1, "cp-5-8/o4:o6#1": 1}
    assert _mine(applied, rerun=True) == {"cp-5-8:ro3": 1, "cp-5-8/ro4:ro6": 1}


def _limit_lines(*spans: tuple[str, float, float]) -> list[dict[str, Any]]:
    out = []
    for step, t_in, t_out in spans:
        base = {"limit": P.CONC_LIMIT, "run": "r", "step": step, "epoch": 1, "pid": 1}
        out += [{**base, "event": "enter", "t": t_in}, {**base, "event": "exit", "t": t_out}]
    return out


def test_an_overlap_is_a_failure_unless_it_began_in_the_restore_gap_after_a_flush(tmp_path):
    path = tmp_path / "limits.jsonl"
    # One body more than the limit holds: at t=11 (after a flush that ended at 10) and
    # at t=50 (long after it).
    n = P.CONCURRENCY + 1
    spans = [(f"a{i}", 10.5 + i / 10, 12) for i in range(n - 1)] + [("c", 11, 12)]
    spans += [(f"d{i}", 49 + i / 10, 51) for i in range(n - 1)] + [("f", 50, 51)]
    path.write_text("".join(json.dumps(e) + "\n" for e in _limit_lines(*spans)))
    flush = Fault(FLUSHALL, 9.0, 10.0)
    found = _overlap(path, [flush], 100.0)
    assert len(found) == 1 and "t=50.000" in found[0]
    assert 10.0 + RESTORE_GAP >= 11  # the first overlap is inside the gap
    assert len(_overlap(path, [], 100.0)) == 2


def test_a_start_after_an_attempt_that_never_ended_is_a_re_execution():
    report = Report(1, 1, [])
    ev = [
        {"run": "r", "step": "s", "epoch": 1, "t": 1.0, "event": "start"},
        {"run": "r", "step": "s", "epoch": 2, "t": 5.0, "event": "start"},  # 1 never ended
        {"run": "r", "step": "s", "epoch": 2, "t": 6.0, "event": "end"},
        {"run": "r", "step": "s", "epoch": 3, "t": 7.0, "event": "start"},  # a retry
        {"run": "r", "step": "u", "epoch": 1, "t": 1.0, "event": "start"},
        {"run": "r", "step": "u", "epoch": 2, "t": 2.0, "event": "start"},  # taken over…
        {"run": "r", "step": "u", "epoch": 1, "t": 3.0, "event": "end"},  # …the zombie ends
    ]
    _interrupted_starts(report, ev)
    assert (report.steps_executed, report.re_executed) == (2, 2)


def test_a_recovery_is_counted_apart_when_it_waited_in_a_limit_or_for_a_replay():
    def start(step: str, epoch: int, attempt: int, t: float, pid: int) -> dict[str, Any]:
        return {
            "run": "r",
            "step": step,
            "epoch": epoch,
            "attempt": attempt,
            "t": t,
            "pid": pid,
            "event": "start",
        }

    ev = [
        start("a", 1, 1, 9.0, 7),
        start("a", 2, 2, 12.5, 8),  # taken over 2.5 s after
        start("c", 1, 1, 9.0, 7),
        start("c", 2, 2, 30.0, 8),  # in the limit's line
        start("d", 1, 3, 9.0, 7),
        start("d", 2, 1, 40.0, 8),  # died, then replayed
    ]
    report = Report(1, 1, [])
    _recoveries(report, ev, [Fault(KILL, 10.0, pid=7)], frozenset({("r", "c")}))
    assert report.kill_to_restart == [2.5]
    assert report.extra["kill_to_restart_in_a_limit_s"]["max"] == 20.0
    assert report.extra["kill_to_restart_after_a_replay_s"]["max"] == 30.0


def test_recovery_quantiles_are_nearest_rank():
    values = [float(i) for i in range(1, 101)]
    assert (_quantile(values, 0.5), _quantile(values, 0.99)) == (50.0, 99.0)
    assert _quantile([3.0], 0.99) == 3.0 and _quantile([], 0.5) is None


def test_the_driver_forgets_a_root_id_that_is_enqueued_again(tmp_path):
    driver = Driver(client=None)  # type: ignore[arg-type]
    driver._status.update({"r": "succeeded", "r/o2": "failed", "rx": "succeeded"})
    driver.forget("r")
    assert driver._status == {"rx": "succeeded"}


def test_the_embedded_default_takes_only_its_own_faults(tmp_path):
    assert ChaosConfig(seed=1, embedded=True).fault_kinds() == list(EMBEDDED_KINDS)
    assert ChaosConfig(seed=1, embedded=True, kinds=[KILL]).fault_kinds() == [KILL]
    assert ChaosConfig(seed=1).fault_kinds() is None
    with pytest.raises(ValueError, match="postgres-restart"):
        ChaosConfig(seed=1, embedded=True, kinds=[KILL, PG_RESTART]).fault_kinds()
    broker = EmbeddedBroker(tmp_path)
    (broker.folder / "queue").mkdir(parents=True)
    for i in range(3):
        (broker.folder / "queue" / f"{i}.msg").write_text("{}")
    broker.flushall()
    assert list((broker.folder / "queue").iterdir()) == []
    assert "--embedded" in ChaosConfig(seed=1, embedded=True, programs=5).command()


def test_the_proxy_forwards_and_a_cut_resets_every_connection_through_it():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo_one, args=(conn,), daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    proxy = Proxy(port).start()
    try:
        a = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        a.sendall(b"ping")
        assert a.recv(4) == b"ping"
        deadline = time.monotonic() + 5
        while proxy.live() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.cut() == 1
        with pytest.raises(OSError):  # reset: the next read or write fails
            a.sendall(b"again")
            if not a.recv(5):
                raise ConnectionResetError("closed")
        b = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        b.sendall(b"pong")
        assert b.recv(4) == b"pong"  # accepted again at once
        assert (proxy.accepted, proxy.cuts) == (2, 1)
    finally:
        proxy.close()
        server.close()


def _echo_one(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(1024):
            conn.sendall(data)


def test_a_tree_that_has_not_ended_is_printed_as_the_store_has_it(tmp_path):
    from fleet import Settings
    from tests.chaos import program_flows
    from tests.chaos.program_chaos import _as_stored

    settings = Settings(
        database_url=f"sqlite:///{tmp_path}/f.db", broker_url=f"filesystem:///{tmp_path}/b"
    )
    client = program_flows.fleet.with_settings(settings)
    client.upgrade_schema()
    client.enqueue(P.WORKFLOW, P.generate(3, 1), run_id="cp-3-1")
    text = _as_stored(client, "cp-3-1")
    assert text.startswith("    run cp-3-1: ('queued', 1, 0,"), text
    client.runtime.db.dispose()


def test_a_worker_inside_a_limit_is_told_from_the_limit_log(tmp_path):
    from tests.chaos.freeze import inside_limits

    path = tmp_path / "limits.jsonl"
    lines = _limit_lines(("a", 1.0, 2.0))  # pid 1 entered and left
    held = {"limit": P.CONC_LIMIT, "run": "r", "step": "b", "epoch": 1, "pid": 9, "t": 3.0}
    lines.append({**held, "event": "enter"})
    rated = {**held, "limit": P.RATE_LIMIT, "pid": 5}  # a rated limit holds no slot
    lines.append({**rated, "event": "enter"})
    path.write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"cut sh')
    assert inside_limits(path) == {9}
    assert inside_limits(tmp_path / "none.jsonl") == set()


def _killed_root(error: str, *children: dict[str, Any]) -> list[dict[str, Any]]:
    lost = [_try("lost", None, 1), _try("failed", "StoreUnavailable: cut", 2)]
    root = _cap("cp-1-2", ("o1", "done", [_try("done")]), ("o3", "dead", lost))
    root["error"] = error
    return [root, *children]


def test_the_console_replays_only_a_root_killed_by_the_one_step_the_faults_killed():
    killed = "StepFailed: step o3 failed after 2 attempt(s): StoreUnavailable: cut"
    assert replayable(_killed_root(killed), "cp-1-2") == ("cp-1-2", "o3")
    # The root's error names another step: its death turned the program elsewhere.
    assert (
        replayable(_killed_root("StepFailed: step o9 failed after 3 attempt(s): x"), "cp-1-2")
        is None
    )
    # An attached child the root's end cancelled stays cancelled after a replay.
    child = _cap("cp-1-2/o5")
    child["status"], child["error"] = "cancelled", "cancelled: parent run cp-1-2 cancelled"
    assert replayable(_killed_root(killed, child), "cp-1-2") is None
    # A second death of faults anywhere in the tree: not the fault-free path either.
    other = _cap("cp-1-2/o6", ("o7", "dead", [_try("lost", None, 1)]))
    assert replayable(_killed_root(killed, other), "cp-1-2") is None
    # A root that ended otherwise, or a death in a child only.
    ok = _killed_root(killed)
    ok[0]["status"] = "succeeded"
    assert replayable(ok, "cp-1-2") is None
    assert replayable([_cap("cp-1-2"), other], "cp-1-2") is None


def test_a_console_decision_reads_as_the_value_it_was_made_for():
    assert P.signal_value({"v": 7}) == 7
    assert P.signal_value({"approved": True, "by": "anonymous", "comment": "7"}) == 7
    assert P.signal_value({"approved": False, "by": "anonymous", "comment": "8"}) == 8
    # The wrong decision for its value, or nobody named: the run will differ.
    assert P.signal_value({"approved": False, "by": "anonymous", "comment": "7"}) == -1
    assert P.signal_value({"approved": True, "by": "", "comment": "7"}) == -1


def test_a_refused_page_reads_as_its_one_error_line():
    page = '<main><p id="error" class="error">run x has already ended\n (failed)</p></main>'
    assert _error_line(page) == "run x has already ended (failed)"
    assert _error_line("<h1>Internal   Server Error</h1>") == "<h1>Internal Server Error</h1>"
