"""The Prometheus scrape endpoint of a service: its own registry on its own HTTP port.

Each service defines its metrics (``stageserve_`` prefix, units in the name) on a
:class:`prometheus_client.CollectorRegistry` of its own (never the process-global one, so tests
and several services in one process never share series) and serves it with
:func:`start_metrics_server` on ``--metrics-port``: the port of the flag, ``0`` for an ephemeral
one, or ``off``. The bound port is logged and, when the service has a ``--port-file``, written
next to it as ``<port-file stem>.metrics-port`` (how tests and the launcher find an ephemeral one).
The served registry also gets prometheus-client's process and platform collectors: ``process_*``
(resident and virtual memory, CPU seconds, open and maximum file descriptors, start time) and
``python_info``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, start_http_server

log = logging.getLogger(__name__)

METRICS_PORT_SUFFIX = ".metrics-port"


def metrics_port_file(port_file: Path) -> Path:
    """Where the bound metrics port is written for a service whose ``--port-file`` is ``port_file``."""
    return port_file.with_suffix(METRICS_PORT_SUFFIX)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int | None, port_file: Path | None = None) -> int | None:
    """Serve ``registry`` (plus the process metrics) at ``http://host:port/metrics`` on a daemon
    thread; return the bound port.

    Args:
        port: the port; ``0`` = ephemeral; ``None`` = no endpoint (returns ``None``).
        port_file: the service's ``--port-file``; the metrics port goes to its sibling
            (:func:`metrics_port_file`), written atomically.

    Raises:
        RuntimeError: the address cannot be bound (the message names it and the flag).
    """
    if port is None:
        return None
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise RuntimeError(f"--metrics-port: cannot listen on {host}:{port} ({exc}); choose a free port, 0 or off") from exc
    bound = httpd.server_port
    if port_file is not None:
        target = metrics_port_file(port_file)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(str(bound))
        tmp.replace(target)
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
