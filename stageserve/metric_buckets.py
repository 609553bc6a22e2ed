"""Histogram buckets that more than one service's metrics use, stated once."""

STEP_HOST_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
"""Seconds of host work per step (prepare's scheduling and plan, reclaim's detokenize and publish):
tens of microseconds to a few milliseconds."""
