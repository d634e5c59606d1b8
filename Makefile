# Everyday commands are ./dev demo and ./dev test (see README). These two run the
# proof under fire and the benchmarks against the local Postgres and Redis; neither
# is part of CI as a timed check (CI runs a small seeded chaos run inside ./dev test).
PY := .venv/bin/python
SEED ?=
REPS ?= 3

.PHONY: setup chaos bench

setup:
	./dev fleet --help >/dev/null
	$(PY) -c "import dbos" 2>/dev/null || $(PY) -m pip install --quiet -e ".[dev,bench]"

# 300 runs × 16 steps on 3 workers, 60 faults; needs root and pg_createcluster (a
# private Postgres cluster and Redis are started, restarted and removed).
chaos: setup
	$(PY) -m tests.chaos --runs 300 --faults 60 $(if $(SEED),--seed $(SEED)) --json bench/out/chaos.json

bench: setup
	$(PY) -m bench.sequential --reps $(REPS)
	$(PY) -m bench.many_runs --reps $(REPS)
	$(PY) -m bench.io_bound --reps $(REPS)
	$(PY) -m bench.recovery --reps 5
	$(PY) -m bench.waiting --reps $(REPS)
	$(PY) -m bench.long_runs --reps $(REPS)
	$(PY) -m bench.transcripts
	$(PY) -m bench.fanout --items 10000
