"""Any value typed at the command line ends as an exit code, never an exception (issue
48, item 8). Hypothesis draws the values of every option and argument of the commands
that read or steer runs (huge and negative whole numbers, NaN and infinities, any text,
JSON of any shape) and runs each in process (typer's CliRunner: hundreds of inputs in
seconds), on both stores; what it found is also tested through the real ``fleet``
command in test_cli_hostile.py. Nothing recorded changes but what a command is for."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fleet import Fleet
from fleet.ops.cli import app
from tests.harness import Backend

KEPT = "kept"  # the one run in the store: a random id never names it
EDGES = [2**31 - 1, 2**31, 3_000_000_000, 2**63 - 1, 2**63, 10**20, 10**23, 0, -1, -(2**63)]
WHOLE = st.one_of(
    st.sampled_from(EDGES),  # either side of what the store keeps (32 and 64 bits)
    st.integers(min_value=-(2**70), max_value=2**70),
).map(str) | st.sampled_from(["nan", "inf", "-inf", "1e308", "-0", "0x10", "1_000", "", " "])
NUMBER = st.one_of(st.floats().map(repr), WHOLE)
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=24)
ID = TEXT.filter(lambda t: t != KEPT)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
JSON = st.one_of(TEXT, JSON_VALUE.map(json.dumps))


def _args(*parts: Any) -> Any:
    return st.tuples(*(st.just(p) if isinstance(p, str) else p for p in parts))


# One value drawn a command, the rest good: a bad one checked first would hide the next.
COMMANDS = st.one_of(
    _args("runs", "--limit", WHOLE),
    _args("runs", "--status", TEXT),
    _args("runs", "--tenant", TEXT),
    _args("status", ID),
    _args("watch", ID, "--timeout", NUMBER),  # never the live run: a good timeout would wait
    _args("transcript", ID),
    _args("transcript", KEPT, "--name", TEXT),
    _args("signal", ID, "go"),
    _args("signal", KEPT, TEXT),
    _args("signal", KEPT, "go", "--data", JSON),
    _args("resolve", KEPT, "--raise-budget", TEXT),
    _args("resolve", KEPT, "--raise-budget", WHOLE.map("tokens={}".format)),
    _args("resolve", KEPT, "--raise-budget", NUMBER.map("cost={}".format)),
    _args("resolve", KEPT, TEXT, "--retry"),
    _args("resolve", KEPT, "work#1", "--output", JSON),
    _args("cancel", ID),
    _args("prune", "--finished-before", TEXT, "--dry-run"),
    _args("prune", "--finished-before", "30d", "--batch", WHOLE, "--dry-run"),
    _args("dlq", "list", "--workflow", TEXT),
    _args("dlq", "list", "--run", TEXT),
    _args("dlq", "show", WHOLE),
    _args("dlq", "replay", WHOLE),
    _args("dlq", "replay", "1", "--input", JSON),
    _args("dlq", "replay", "--all", "--rate", NUMBER, "--workflow", "none"),
    _args("messages", "list", "--limit", WHOLE),
    _args("messages", "show", WHOLE),
    _args("messages", "purge", WHOLE),
    _args("replay", ID, "-A", "tests.flows"),
    _args("replay", KEPT, "-A", "tests.flows", "--workflow", TEXT),
    _args("replay", "-A", "tests.flows", "--file", TEXT),
    _args("export", ID),
)


def test_no_value_at_the_command_line_raises(backend: Backend, client: Fleet) -> None:
    client.enqueue("chain", 1, run_id=KEPT)  # queued: no worker runs it
    runner = CliRunner()
    env = backend.env()

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(args=COMMANDS)
    def each(args: tuple[str, ...]) -> None:
        done = runner.invoke(app, list(args), env=env)
        if done.exception is not None and not isinstance(done.exception, SystemExit):
            raise AssertionError(f"fleet {list(args)!r} raised") from done.exception
        assert done.exit_code in (0, 1, 2), (args, done.output)

    each()
    assert [(r.id, r.status) for r in client.runtime.queries.runs()] == [(KEPT, "queued")]
