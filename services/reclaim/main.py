"""``stageserve reclaim``: the reclaim service's entry point (completion, detokenize, stops, publish).

Its flags are in ``flags.py``, its assembly in ``assembly.py``, its servicer in ``service.py`` and
its links to the devices in ``links.py``. Heavy imports (transformers, via the assembly) happen in
:func:`run`, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import threading

from stageserve.model_files import resolve_model_path
from stageserve.reclaim.flags import add_arguments, check_flags
from stageserve.security.config import ServiceSecurity
from stageserve.server import configure_logging

__all__ = ["add_arguments", "run"]  # stageserve.cli reads both here

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    """Run the reclaim service until SIGTERM/SIGINT/SIGHUP; return the exit code (0 after a drain, 2 on
    a bad flag, or when the port, the metrics port or the trace folder cannot be used).

    Readiness (``stageserve.v1.Reclaim``) is SERVING only while the tokenizer is loaded and at least
    one device is attached. On SIGTERM: NOT_SERVING, wait up to ``--drain-timeout`` for live requests
    to finish, fail the rest with ``UNAVAILABLE``, end the subscriber streams, write the trace
    window (``--trace-dir``), stop.
    """
    configure_logging(args.log_level, args.log_format, "reclaim")
    problem = check_flags(args)
    if problem:
        log.error("%s", problem)
        return 2
    try:
        model_path = resolve_model_path(args.model)
        security = ServiceSecurity.from_args(args, serves_internal=True)
    except (FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    from stageserve.reclaim.assembly import attach_devices, open_server  # imports transformers

    try:
        reclaim = open_server(args, security)
    except (ValueError, RuntimeError, OSError) as exc:
        log.error("%s", exc)
        return 2
    draining = threading.Event()
    links = attach_devices(args, model_path, reclaim, security, draining)
    links.start()

    def drain() -> None:
        draining.set()
        if not links.wait_idle(args.drain_timeout):
            log.warning("drain timeout (%g s) passed with requests live; failing them", args.drain_timeout)
        links.stop()
        reclaim.publisher.close()

    reclaim.server.run_until_stopped(drain)
    return 0
