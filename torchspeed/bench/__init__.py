"""Benchmarks: the timing harness, the suites, the report."""
