"""Server bootstrap shared by the three services: gRPC server, health, reflection, port report,
SIGTERM drain.

:class:`ServiceServer` is grpcio's synchronous server (a thread per running RPC; device and
reclaim). :class:`AioServiceServer` is the same server on ``grpc.aio``, its event loop on a thread of
its own (prepare: a coroutine per open stream, where a handler thread costs two GIL hand-offs per
streamed message); the rest of the process stays threaded.

Follows grpc's own Python examples: the library's health servicer is set to SERVING only when
the service is ready; ``server.stop(grace)`` on shutdown; server reflection so that
``grpcurl -plaintext HOST:PORT list`` works without .proto files (and ``describe`` shows the proto
comments, :mod:`stageserve.reflection`).

Health: the empty service name ``""`` is liveness (SERVING while the process runs); the service's
full name (e.g. ``stageserve.v1.Device``) is readiness (NOT_SERVING until :meth:`ServiceServer.set_ready`,
and again from SIGTERM on).

Given the service's :class:`~stageserve.tracing.Tracer`, the server also serves
``stageserve.v1.Admin`` (``StartProfile`` / ``StopProfile``, see :mod:`stageserve.profiling`) and
writes a window still recording at shutdown (``--trace-dir``). The flags every service shares are
defined once, in :func:`add_service_arguments`.

Security (:mod:`stageserve.security`): every server runs the guard interceptor (undecodable
requests get ``INVALID_ARGUMENT``; access classes per service); the listener is plaintext or TLS
(mutual TLS where the service serves internal RPCs); ``--health-port`` adds a plaintext server
with the health service alone, for probes that cannot do TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import tempfile
import threading
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stageserve.logs import LOG_FORMATS, JsonFormatter, TextFormatter
from stageserve.profiling import ADMIN_SERVICE_NAME, ProfileServicer
from stageserve.reflection import enable_reflection
from stageserve.security.config import ServiceSecurity, add_security_arguments
from stageserve.security.guard import AioGuardInterceptor, SyncGuardInterceptor
from stageserve.stop_signals import StopRequest
from stageserve.tracing import Tracer
from stageserve.v1 import admin_pb2_grpc

log = logging.getLogger(__name__)

# Large enough for a step plan or event batch of a big batch; the default 4 MiB is not.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Peer channels (prepare → device/reclaim, reclaim → device) ping every 10 s so that a peer that
# vanished without closing its connection (a killed pod) is noticed within ~15 s.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Servers accept those pings: by default they answer pings more often than every 5 min with a
# GOAWAY ("too_many_pings") and the connection drops.
_PING_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
HEALTH_PORT_SUFFIX = ".health-port"


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, object]]:
    """A server's channel options; a larger message than ``max_receive_bytes`` is refused by grpc
    with ``RESOURCE_EXHAUSTED`` before it is decoded."""
    limit = "grpc.max_receive_message_length"
    return [(name, max_receive_bytes if name == limit else value) for name, value in GRPC_OPTIONS] + _PING_OPTIONS


class ServiceServer:
    """A gRPC server with health and reflection, listening on ``host:port`` (port 0 = ephemeral).

    Args:
        service_name: full name of the service's readiness entry, e.g. ``"stageserve.v1.Device"``.
        host, port: where to listen; the bound port is in :attr:`port` after construction.
        max_workers: threads serving RPCs (each open stream holds one).
        port_file: if given, the bound port is written there once the server has started, so a
            launcher or test that asked for port 0 learns it.
        tracer: the service's tracer; serves ``stageserve.v1.Admin`` over it, and a window still
            recording is written after the drain at shutdown.
        profile_peers: service name -> ``HOST:PORT`` that ``StartProfile``/``StopProfile`` are
            forwarded to (prepare: its device and reclaim).
        security: TLS, access policy and health port (default: plaintext, open, no health port).
        max_receive_bytes: the largest request message accepted (``RESOURCE_EXHAUSTED`` beyond).
        profile_dir: the folder ``StartProfile`` windows go under (by name); ``None``: StartProfile is refused.

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
        tracer: Tracer | None = None,
        profile_peers: Mapping[str, str] | None = None,
        security: ServiceSecurity | None = None,
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        profile_dir: Path | None = None,
    ) -> None:
        self.service_name = service_name
        self.security = security or ServiceSecurity()
        pool = futures.ThreadPoolExecutor(max_workers=max_workers)
        self.server, self.health = self._call(self._new_server, pool, server_options(max_receive_bytes))
        self._call(health_pb2_grpc.add_HealthServicer_to_server, self.health, self.server)
        self._tracer = tracer
        if tracer is not None:
            profiler = ProfileServicer(tracer, profile_dir, profile_peers, tls=self.security.tls)
            self._call(admin_pb2_grpc.add_AdminServicer_to_server, profiler, self.server)
        self._port_file = port_file
        self._host = host
        self.port = self._call(self._listen, self.server, host, port, self.security)
        self.health_server, self.health_port = None, None
        if self.security.health_port is not None:
            self.health_server = self._call(self._new_health_server, pool)
            self.health_port = self._call(self._listen, self.health_server, host, self.security.health_port, None)
        self._stop_requested = StopRequest()

    def add_servicer(self, add_fn: Callable[[object, grpc.Server], None], servicer: object) -> None:
        """Register a servicer (``add_XServicer_to_server``, servicer instance)."""
        self._call(add_fn, servicer, self.server)

    def start(self, reflected_services: list[str]) -> None:
        """Start serving: liveness SERVING, readiness NOT_SERVING, reflection for the given services."""
        admin = [ADMIN_SERVICE_NAME] if self._tracer is not None else []
        self._call(enable_reflection, [*reflected_services, *admin, health.SERVICE_NAME], self.server)
        self._call(self.health.set, "", health_pb2.HealthCheckResponse.SERVING)
        self._call(self.health.set, self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._call(self.server.start)
        if self.health_server is not None:
            self._call(self.health_server.start)
        if self._port_file is not None:
            _write_port(self._port_file, self.port)
            if self.health_port is not None:
                _write_port(self._port_file.with_suffix(HEALTH_PORT_SUFFIX), self.health_port)
        log.info("%s listening on %s:%d (%s)", self.service_name, self._host, self.port, self.security.describe())
        if self.health_port is not None:
            log.info("health only, plaintext, on %s:%d", self._host, self.health_port)

    def set_ready(self, ready: bool) -> None:
        """Set readiness (the service name's health status). Never waits for the server's threads:
        callers may hold locks that RPC handlers take (prepare's connector does)."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self._submit(self.health.set, self.service_name, status)

    def stop(self, grace_s: float | None) -> None:
        """Health NOT_SERVING for good, then stop the server: new RPCs are refused, running ones get
        ``grace_s`` seconds (``None``: none) before they are cancelled. Returns once stopped."""
        self._call(self.health.enter_graceful_shutdown)
        if self.health_server is not None:
            self.health_server.stop(None)
        self.server.stop(grace_s).wait()

    @property
    def stop_requested(self) -> bool:
        """Whether a stop was asked for (a lock-free read: any thread)."""
        return self._stop_requested.requested

    def request_stop(self) -> None:
        """Ask :meth:`run_until_stopped` to drain and return (what SIGTERM/SIGINT/SIGHUP do)."""
        self._stop_requested.request()

    def handle_stop_signals(self) -> None:
        """Make SIGTERM/SIGINT/SIGHUP call :meth:`request_stop` (:mod:`stageserve.stop_signals`: no
        lock, so a handler never deadlocks the waiter). Main thread only (Python's rule for handlers)."""
        self._stop_requested.handle_signals()

    def run_until_stopped(self, drain: Callable[[], None], grace_s: float = 5.0) -> None:
        """Block until SIGTERM/SIGINT/SIGHUP (or :meth:`request_stop`), then drain and stop.

        Order: readiness NOT_SERVING (load balancers stop sending), ``drain()`` (the service
        finishes or fails its in-flight work within its drain timeout), write the trace window
        still recording, then :meth:`stop` with ``grace_s``. On the main thread this installs the
        signal handlers itself; a service that calls it from another thread calls
        :meth:`handle_stop_signals` on the main thread first (and keeps that thread returning to
        Python at least every 0.2 s, so the handlers run: a signal lands on whichever thread the
        kernel picks, often a gRPC worker, and Python runs its handler on the main thread only).
        """
        if threading.current_thread() is threading.main_thread():
            self.handle_stop_signals()
        self._stop_requested.wait()
        log.info("%s: stop requested, draining", self.service_name)
        self.set_ready(False)
        drain()
        self._write_trace_window()
        self.stop(grace_s)
        log.info("%s: stopped", self.service_name)

    def _new_server(self, pool: futures.ThreadPoolExecutor, options: list) -> tuple[Any, Any]:
        """The gRPC server and its health servicer; ``pool`` runs the RPC handlers."""
        server = grpc.server(pool, options=options, interceptors=[SyncGuardInterceptor(self.security.policy)])
        return server, health.HealthServicer(experimental_non_blocking=True)

    def _new_health_server(self, pool: futures.ThreadPoolExecutor) -> Any:
        """The plaintext server of ``--health-port``: the same health servicer, nothing else."""
        server = grpc.server(pool, options=server_options(), interceptors=[SyncGuardInterceptor(self.security.policy)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        return server

    @staticmethod
    def _listen(server: Any, host: str, port: int, security: ServiceSecurity | None) -> int:
        """Bind ``server`` (TLS per ``security``; ``None``: plaintext); the bound port. Raises RuntimeError."""
        address = f"{host}:{port}"
        try:
            if security is not None and security.tls is not None and security.tls.serves_tls:
                return server.add_secure_port(address, security.tls.server_credentials(security.require_client_cert))
            return server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {address}: {exc}") from exc

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` where the server's objects may be used (here: any thread)."""
        return fn(*args)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` as :meth:`_call`, without waiting for it where it runs elsewhere; calls apply in order."""
        fn(*args)

    def _write_trace_window(self) -> None:
        if self._tracer is None or not self._tracer.enabled:
            return
        try:
            log.info("trace window written to %s", self._tracer.stop())
        except (OSError, RuntimeError) as exc:  # a StopProfile may have raced us; never block the shutdown
            log.warning("trace window not written: %s", exc)


class AioServiceServer(ServiceServer):
    """:class:`ServiceServer` on ``grpc.aio``: the servicers' ``async def`` handlers run as
    coroutines on one event loop, which runs on a thread of its own (``thread_name``), so the
    caller's threads (and the main thread's signal wait in :meth:`run_until_stopped`) stay as they are.

    Same arguments and health, reflection, Admin, port file and shutdown as :class:`ServiceServer`,
    except ``max_workers``: the threads of the loop's default executor, which also runs synchronous
    handlers (Admin's, which dial peers; ``grpc.aio``'s ``migration_thread_pool``) and whatever a
    handler hands to ``loop.run_in_executor(None, ...)``. Every method may be called from any thread
    but the loop's; the server's objects are used on the loop only (``grpc.aio`` binds them to it).

    Raises:
        RuntimeError: the address could not be bound.
    """

    def __init__(self, *args: Any, thread_name: str = "grpc-aio", **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._submitted: set[asyncio.Future] = set()
        self._loop_thread = threading.Thread(target=self._run_loop, name=thread_name, daemon=True)
        self._loop_thread.start()
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self._stop_loop()
            raise

    def stop(self, grace_s: float | None) -> None:
        """As :meth:`ServiceServer.stop`, then end the event loop and its thread."""
        self._call(self.health.enter_graceful_shutdown)
        if self.health_server is not None:
            self._call(self.health_server.stop, None)
        self._call(self.server.stop, grace_s)
        self._stop_loop()

    def _new_server(self, pool: futures.ThreadPoolExecutor, options: list) -> tuple[Any, Any]:
        self.loop.set_default_executor(pool)
        server = grpc.aio.server(pool, options=options, interceptors=[AioGuardInterceptor(self.security.policy)])
        return server, health.aio.HealthServicer()

    def _new_health_server(self, pool: futures.ThreadPoolExecutor) -> Any:
        server = grpc.aio.server(pool, options=server_options(), interceptors=[AioGuardInterceptor(self.security.policy)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        return server

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the loop (awaited there if it returns an awaitable); blocks until done.

        Raises:
            RuntimeError: called on the loop's own thread (it would wait for itself).
        """
        if threading.current_thread() is self._loop_thread:
            raise RuntimeError(f"{getattr(fn, '__qualname__', fn)} must not be called from the gRPC event loop's thread")

        async def call() -> Any:
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop and return at once; submitted calls start in order.

        Waiting here could deadlock: prepare's connector sets readiness while holding the lock that
        handlers on the loop take to place a request. A call after the loop closed does nothing.
        """
        def start() -> None:
            result = fn(*args)
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._submitted.add(task)  # a reference, so the task is not collected mid-run
                task.add_done_callback(self._submitted.discard)

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def _stop_loop(self) -> None:
        """End the loop and its thread; closing the loop shuts its default executor down."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join()


def add_service_arguments(parser: argparse.ArgumentParser, default_port: int, default_metrics_port: int) -> None:
    """Add the flags every service shares to ``parser`` (the one place they are defined).

    ``--host``, ``--port`` (``default_port``; 0 = ephemeral), ``--port-file``, ``--log-level``,
    ``--log-format``, ``--drain-timeout``, ``--trace-dir`` and ``--metrics-port``
    (``default_metrics_port``; 0 = ephemeral, ``off`` = no endpoint; parsed to ``None`` for off).
    """
    group = parser.add_argument_group("service (common to prepare, device and reclaim)")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on, gRPC and metrics (default %(default)s)")
    group.add_argument("--port", type=_port, default=default_port, help="gRPC port; 0 = ephemeral (default %(default)s)")
    group.add_argument("--port-file", type=Path, default=None, metavar="PATH",
                       help="write the bound gRPC port here once listening (and the metrics port to its sibling *.metrics-port)")
    group.add_argument("--log-level", type=str.upper, default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                       help="(default %(default)s)")
    group.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                       help="text: human-readable lines; json: one JSON object per line (default %(default)s)")
    group.add_argument("--drain-timeout", type=_non_negative_float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, how long in-flight work may take before it is failed (default %(default)s)")
    group.add_argument("--trace-dir", type=Path, default=None, metavar="DIR",
                       help="record a Chrome trace from start-up, written to DIR at shutdown (or by Admin.StopProfile)")
    group.add_argument("--profile-dir", type=Path, default=None, metavar="DIR",
                       help="the folder Admin.StartProfile windows go under, in a subfolder the caller names"
                            " (default: --trace-dir if given, else <temp>/stageserve-profiles)")
    group.add_argument("--metrics-port", type=_metrics_port, default=default_metrics_port, metavar="PORT",
                       help="Prometheus /metrics port; 0 = ephemeral, off = none (default %(default)s)")
    add_security_arguments(parser, _port)


def profile_dir(args: argparse.Namespace) -> Path:
    """Where ``StartProfile`` windows go: ``--profile-dir``, else ``--trace-dir``, else ``<temp>/stageserve-profiles``."""
    return args.profile_dir or args.trace_dir or Path(tempfile.gettempdir()) / "stageserve-profiles"


def _write_port(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)  # atomic: a reader never sees a partial number


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0 = ephemeral), got {value}")
    return value


def _metrics_port(text: str) -> int | None:
    return None if text.lower() == "off" else _port(text)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def configure_logging(level: str = "INFO", log_format: str = "text", service: str = "") -> None:
    """Log to stderr at ``level`` in ``log_format`` (see :mod:`stageserve.logs`): ``text``
    (time, level, logger, message, ``[request_id=...]``) or ``json`` (one object per line,
    ``service`` in each).

    Raises:
        ValueError: an unknown ``log_format``.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format {log_format!r}: choose one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else TextFormatter())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
