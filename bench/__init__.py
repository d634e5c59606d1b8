"""Benchmarks and the chaos harness (issue #7). Run through ``make bench`` / ``make chaos``."""
