"""``stageserve prepare``: the public Generation API, validation and the continuous-batching scheduler.

The entry point; its flags are in ``flags.py``, its assembly in ``assembly.py``, its servicer in ``service.py``.

Dials reclaim (``--reclaim``) and every device service (``--device``: a list, or a ``dns:///``
name re-resolved every ``--device-refresh-s``), keeps reconnecting with backoff, and places each
request on one device (``router.py``). Readiness is SERVING while reclaim is subscribed and at least
one device takes requests. The public API is served on ``grpc.aio``: one event loop on the thread
``prepare-grpc``, one coroutine per RPC; the scheduler and the links keep their threads. SIGTERM:
readiness NOT_SERVING, new requests refused with ``UNAVAILABLE`` ("server is draining"), in-flight
requests complete for up to ``--drain-timeout`` seconds, exit 0. ``--http-port`` also serves the
OpenAI-compatible HTTP API (``openai_api.py``) on the same event loop, through the same frontend.
Security (``stageserve.security``): ``--api-keys-file`` / ``--admin-keys-file`` make both APIs
need a key (each key's request ids its own); ``--tls-cert``/``--tls-key`` serve TLS on gRPC and
HTTP, and with ``--tls-ca`` the device and reclaim are dialled over mutual TLS.
"""

from __future__ import annotations

import argparse
import logging

from stageserve.prepare.flags import add_arguments

__all__ = ["add_arguments", "run"]  # stageserve.cli reads both here

log = logging.getLogger("stageserve.prepare")

PREPARE_MALLOC_ARENAS = 2
"""glibc heaps for prepare's threads (`cap_malloc_arenas`): its validation workers' large transient
encodings would otherwise leave fragments in a heap per worker."""


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT/SIGHUP; return the exit code (0 after a clean drain, 2 when it cannot start)."""
    from stageserve.prepare.assembly import build_prepare
    from stageserve.process_memory import cap_malloc_arenas
    from stageserve.server import configure_logging

    cap_malloc_arenas(PREPARE_MALLOC_ARENAS)
    configure_logging(args.log_level, args.log_format, "prepare")
    try:
        prepare = build_prepare(args)
    except (OSError, ValueError, RuntimeError) as exc:  # FileNotFoundError is an OSError
        log.error("%s", exc)
        return 2
    prepare.connector.start()

    def drain() -> None:
        prepare.router.drain(args.drain_timeout)
        if prepare.http is not None:
            prepare.http.stop(timeout_s=1.0)  # its requests have ended (or failed) with the drain
        prepare.connector.stop()

    prepare.server.run_until_stopped(drain)
    return 0
