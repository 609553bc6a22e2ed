"""Offline tools for the Chrome traces of :mod:`stageserve.tracing`: merge the per-service
fragments, analyze step and request timing, plot a timeline (``stageserve trace ...``)."""
