"""Server bootstrap shared by the three services: gRPC server, health, reflection, port report,
SIGTERM drain.

Follows grpc's own Python examples: the library's health servicer is set to SERVING only when
the service is ready; ``server.stop(grace)`` on shutdown; server reflection so that
``grpcurl -plaintext HOST:PORT list`` works without .proto files.

Health: the empty service name ``""`` is liveness (SERVING while the process runs); the service's
full name (e.g. ``stageserve.v1.Device``) is readiness (NOT_SERVING until :meth:`ServiceServer.set_ready`,
and again from SIGTERM on).
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Large enough for a step plan or event batch of a big batch; the default 4 MiB is not.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class ServiceServer:
    """A gRPC server with health and reflection, listening on ``host:port`` (port 0 = ephemeral).

    Args:
        service_name: full name of the service's readiness entry, e.g. ``"stageserve.v1.Device"``.
        host, port: where to listen; the bound port is in :attr:`port` after construction.
        max_workers: threads serving RPCs (each open stream holds one).
        port_file: if given, the bound port is written there once the server has started, so a
            launcher or test that asked for port 0 learns it.

    Raises:
        RuntimeError: the address could not be bound.
    """

    def __init__(
        self,
        service_name: str,
        host: str,
        port: int,
        max_workers: int = 64,
        port_file: Path | None = None,
    ) -> None:
        self.service_name = service_name
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._port_file = port_file
        self._host = host
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {host}:{port}: {exc}") from exc
        self._stop_requested = threading.Event()

    def add_servicer(self, add_fn: Callable[[object, grpc.Server], None], servicer: object) -> None:
        """Register a servicer (``add_XServicer_to_server``, servicer instance)."""
        add_fn(servicer, self.server)

    def start(self, reflected_services: list[str]) -> None:
        """Start serving: liveness SERVING, readiness NOT_SERVING, reflection for the given services."""
        reflection.enable_server_reflection(
            [*reflected_services, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.start()
        if self._port_file is not None:
            tmp = self._port_file.with_suffix(".tmp")
            tmp.write_text(str(self.port))
            tmp.replace(self._port_file)  # atomic: a reader never sees a partial number
        log.info("%s listening on %s:%d", self.service_name, self._host, self.port)

    def set_ready(self, ready: bool) -> None:
        """Set readiness (the service name's health status)."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(self.service_name, status)

    def request_stop(self) -> None:
        """Ask :meth:`run_until_stopped` to drain and return (what SIGTERM/SIGINT do)."""
        self._stop_requested.set()

    def run_until_stopped(self, drain: Callable[[], None], grace_s: float = 5.0) -> None:
        """Block until SIGTERM/SIGINT (or :meth:`request_stop`), then drain and stop.

        Order: readiness NOT_SERVING (load balancers stop sending), ``drain()`` (the service
        finishes or fails its in-flight work within its drain timeout), then ``server.stop(grace_s)``.
        """
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop_requested.set())
        self._stop_requested.wait()
        log.info("%s: stop requested, draining", self.service_name)
        self.set_ready(False)
        drain()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        log.info("%s: stopped", self.service_name)


def configure_logging(level: str = "INFO") -> None:
    """Human-readable logs on stderr: time, level, service logger, message."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
