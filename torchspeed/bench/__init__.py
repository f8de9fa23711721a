"""Benchmarks: the suites and the report (timing is torchspeed.measure)."""
