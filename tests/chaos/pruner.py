"""``python -m tests.chaos.pruner APP``: retention for the chaos run, in a process of its
own started with the workers' environment, so it prunes with the engine they run (a
planted bug's copy of fleet, if any; the harness's own process runs fleet itself).

It reads one whole number of seconds a line on stdin and answers each with one line:
how many runs ``Fleet.prune`` deleted that finished that long ago or earlier, or
``error: …`` (the store unreachable, say). ``fleet prune`` does the same once per
process start, which costs a second of CPU each time; this costs one start.
"""

from __future__ import annotations

import sys

from fleet.ops.loader import load_fleet


def main(argv: list[str]) -> int:
    # As ``-A`` finds it; its settings from the environment, as a worker's.
    fleet = load_fleet(argv[0])
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            seconds = int(line)
            print(fleet.prune(seconds).runs, flush=True)
        except Exception as exc:  # one line back; the harness counts it and goes on
            print(f"error: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
