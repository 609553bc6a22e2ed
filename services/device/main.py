"""``stageserve device``: the device service's entry point (its flags: ``flags.py``; its assembly: ``assembly.py``).

Start-up order: listen (readiness NOT_SERVING) → load the weights → size and allocate the KV pool
→ run ONE warm-up step through the executor → readiness SERVING. torch is imported inside
:func:`run`, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from stageserve.device.assembly import build_core
from stageserve.device.flags import add_arguments, check_flags
from stageserve.model_files import resolve_model_path
from stageserve.security.config import ServiceSecurity
from stageserve.server import configure_logging, profile_dir

__all__ = ["add_arguments", "run"]  # stageserve.cli reads both here

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    """Run the device service; return the exit code (0 after SIGTERM and drain, 2 on bad flags or model)."""
    configure_logging(args.log_level, args.log_format, "device")
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

    if args.backend == "cpu" and args.threads is None:  # the CPUs it may use, not the host's (kernels/cpu_budget.py)
        from stageserve.device.kernels.cpu_budget import default_compute_threads

        args.threads = default_compute_threads()
    import torch  # noqa: F401 - heavy imports only past --help
    from prometheus_client import CollectorRegistry

    from stageserve.device import service
    from stageserve.device.metrics import DeviceMetrics
    from stageserve.metrics_http import start_metrics_server
    from stageserve.server import ServiceServer
    from stageserve.tracing import Tracer
    from stageserve.v1 import device_pb2_grpc

    # 1. Listen at once, NOT_SERVING, so orchestrators see a live process while the model loads.
    tracer = Tracer("device")
    metrics = DeviceMetrics(CollectorRegistry(), args.dispatch)
    try:
        server = ServiceServer(service.SERVICE_NAME, args.host, args.port, port_file=args.port_file, tracer=tracer, security=security,
                               profile_dir=profile_dir(args))
        start_metrics_server(metrics.registry, args.host, args.metrics_port, args.port_file)
    except (RuntimeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    servicer = service.DeviceServicer()
    server.add_servicer(device_pb2_grpc.add_DeviceServicer_to_server, servicer)
    server.start([service.SERVICE_NAME])
    if args.backend != "cpu":
        core = _load(args, model_path, server, tracer, metrics)
        return core if isinstance(core, int) else _serve(args, server, servicer, tracer, metrics, core)
    # The cpu backend computes on this (the main) thread, where torch's OpenMP pool is fastest
    # (see `stageserve.device.backends`); loading, then serving and draining, run on helper threads.
    # Loading gets its own thread that ends before serving starts: a live thread that has run
    # torch's parallel ops keeps OpenMP workers, and with more OpenMP threads than cores libgomp's
    # idle workers sleep instead of spinning (measured: a 1-row step took 52 ms with the loading
    # thread alive, 37 ms without).
    from stageserve.device.backends import create_backend

    backend = create_backend("cpu", args.threads, on_caller=True, adaptive_threads=args.adaptive_threads)
    core = backend.serve_while(lambda: _load(args, model_path, server, tracer, metrics, backend))
    if isinstance(core, int):
        return core
    # Only now: a signal during loading keeps its default action and stops the process at once.
    server.handle_stop_signals()
    return backend.serve_while(lambda: _serve(args, server, servicer, tracer, metrics, core))


def _load(args: argparse.Namespace, model_path: Path, server, tracer, metrics, backend=None):
    """Load the model onto ``backend`` (made from the flags when ``None``), size the KV pool, warm up.

    Returns the `DeviceCore`, or the exit code 2 after logging why it could not be built.
    """
    from stageserve.device.model.config import ModelLoadError

    try:
        return build_core(args, model_path, tracer, metrics, backend)
    except (ModelLoadError, FileNotFoundError) as exc:
        log.error("cannot load the model: %s", exc)
    except RuntimeError as exc:  # device not available, KV pool does not fit, ...
        log.error("%s", exc)
    server.server.stop(0)
    return 2


def _serve(args: argparse.Namespace, server, servicer, tracer, metrics, core) -> int:
    """Serve ``core`` until SIGTERM/SIGINT/SIGHUP, drain, stop; the exit code."""
    # 3. Measure and trace from the first real step on (not the warm-up); serve until SIGTERM, then drain.
    metrics.start()
    if args.trace_dir:
        try:
            tracer.start(args.trace_dir)
        except OSError as exc:
            log.error("--trace-dir: %s", exc)
            server.server.stop(0)
            return 2
    servicer.serve(core)
    server.set_ready(True)
    reply = core.attach_reply
    metrics.describe_model(reply.model_name, reply.backend, reply.dtype)
    log.info("device ready: %s on %s (%s, %s dispatch, depth %d), %d KV blocks of %d tokens, instance %s",
             reply.model_name, reply.backend, reply.dtype, reply.dispatch, reply.pipeline_depth, reply.kv_num_blocks, reply.kv_block_size, reply.instance_id)

    def drain() -> None:
        # One deadline for all three waits: prepare lets go of this device once its requests ended
        # (it stops placing new ones here as soon as readiness turns NOT_SERVING), then the last
        # steps complete and reclaim takes their outputs.
        deadline = time.monotonic() + args.drain_timeout
        if (servicer.wait_execute_closed(args.drain_timeout)
                and core.executor.flush(max(0.0, deadline - time.monotonic()))
                and core.outbox.wait_empty(max(0.0, deadline - time.monotonic()))):
            servicer.end_complete_streams()
        else:
            log.warning("drain timeout (%g s): requests, steps or outputs still in flight", args.drain_timeout)

    server.run_until_stopped(drain)
    core.executor.close()
    return 0
