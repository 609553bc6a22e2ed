"""Benchmarks: the ``stageserve bench`` load generator, the in-process baseline and the comparison runs."""
