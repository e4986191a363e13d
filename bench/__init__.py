"""Benchmarks: workloads (datasets), drivers (offline, serving, peers), comparison (compare)."""
