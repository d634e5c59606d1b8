# Everyday commands are ./dev demo and ./dev test (see README). These two run the
# proof under fire and the benchmarks against the local Postgres and Redis; neither
# is part of CI as a timed check (CI runs a small seeded chaos run inside ./dev test).
PY := .venv/bin/python
SEED ?=
REPS ?= 3

.PHONY: setup chaos chaos-embedded chaos-mixed bench bench-quick

setup:
	./dev fleet --help >/dev/null
	$(PY) -c "import dbos" 2>/dev/null || $(PY) -m pip install --quiet -e ".[dev,bench]" -c constraints.txt

# 1,000 generated programs on 3 workers, 100 faults, checked against their model;
# needs root and pg_createcluster (a private Postgres cluster and Redis are started,
# restarted and removed). chaos-embedded: the same on SQLite and the filesystem broker
# (kills, freezes, flushes, duplicates). chaos-mixed: the first week's workload.
chaos: setup
	$(PY) -m tests.chaos --programs 1000 --faults 100 $(if $(SEED),--seed $(SEED)) --json bench/out/chaos.json

chaos-embedded: setup
	$(PY) -m tests.chaos --embedded --programs 1000 --faults 100 $(if $(SEED),--seed $(SEED)) --json bench/out/chaos-embedded.json

chaos-mixed: setup
	$(PY) -m tests.chaos --runs 300 --faults 60 $(if $(SEED),--seed $(SEED)) --json bench/out/chaos-mixed.json

bench: setup
	$(PY) -m bench.sequential --reps $(REPS)
	$(PY) -m bench.many_runs --reps $(REPS)
	$(PY) -m bench.io_bound --reps $(REPS)
	$(PY) -m bench.recovery --reps 5
	$(PY) -m bench.waiting --reps $(REPS)
	$(PY) -m bench.long_runs --reps $(REPS)
	$(PY) -m bench.transcripts
	$(PY) -m bench.fanout --items 10000

# Every benchmark that has a target, at a small size, in about five minutes: each ratio
# beside its target (bench/quick.py). Run it before an engine change is resolved.
bench-quick: setup
	$(PY) -m bench.quick
