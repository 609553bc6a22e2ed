"""``stageserve up``: the three services as local child processes, on the embedded model by default.

Starts device, then reclaim (dials device), then prepare (dials both), each on its own port, waits
until all three report readiness through ``grpc.health.v1``, optionally streams one chat answer, and
serves until Ctrl-C, SIGTERM or SIGHUP. The services' logs go to one file each in a folder that ``up``
prints (``--verbose``: to the terminal instead), so the terminal shows only the launcher's lines.

Shutdown: each service runs in a session of its own, so a terminal's Ctrl-C reaches only the
launcher, which then stops the services one at a time with SIGTERM, in the order in which each
one's drain can complete: prepare (finishes the requests in flight, then lets the device go), the
device (its last steps complete and reclaim, still up, takes their outputs), then reclaim. Each
gets its drain timeout plus the server's stop grace before SIGKILL.

:class:`ServiceProcess` and :func:`start_pipeline` are also what the integration tests use, so the
tests start the services exactly the way users do.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from stageserve.device.flags import DENSE_COPY_MODES, SPECULATIVE_POLICIES, WEIGHT_FORMATS, parse_bytes
from stageserve.metrics_http import metrics_port_file
from stageserve.prepare.openai_flags import add_openai_arguments, openai_argv
from stageserve.security.tls import TlsFiles, dial
from stageserve.stop_signals import STOP_SIGNALS, StopRequest

SERVICE_NAMES = {
    "prepare": "stageserve.v1.Generation",
    "device": "stageserve.v1.Device",
    "reclaim": "stageserve.v1.Reclaim",
}

# Seconds a stopped service may take beyond its drain timeout (the server's stop grace, then the
# interpreter's exit) before it is killed.
STOP_MARGIN_S = 15.0


class ServiceProcess:
    """One stageserve service running as a child process (``python -m stageserve ROLE ...``).

    The service binds ``--port`` (0 = ephemeral) and writes the bound port to a port file, which
    :meth:`wait_port` reads. With ``port`` 0 its Prometheus endpoint is ephemeral too
    (``--metrics-port 0``, unless ``args`` choose one), so parallel deployments never collide;
    :attr:`metrics_port` reads it. Output goes to ``log_path``. The process starts a session of its
    own, so signals a terminal sends to its foreground group (Ctrl-C) never reach it: whoever
    started it stops it, by pid (:meth:`stop`).

    Args:
        role: ``prepare``, ``device`` or ``reclaim``.
        args: extra command-line flags for the service.
        workdir: folder for the port file.
        port: port to bind (0 = ephemeral).
        log_path: file that receives the process's stdout and stderr; None = inherit ours.
        tls: the TLS files the launcher checks readiness with (the service's ``--tls-*``); None = plaintext.
    """

    def __init__(self, role: str, args: list[str], workdir: Path, port: int = 0, log_path: Path | None = None,
                 tls: TlsFiles | None = None) -> None:
        self.role = role
        self.tls = tls
        self.port_file = workdir / f"{role}.port"
        self.port_file.unlink(missing_ok=True)
        metrics_port_file(self.port_file).unlink(missing_ok=True)
        self.log_path = log_path
        ephemeral_metrics = ["--metrics-port", "0"] if port == 0 and "--metrics-port" not in args else []
        self.command = [sys.executable, "-m", "stageserve", role, "--port", str(port), "--port-file", str(self.port_file),
                        *ephemeral_metrics, *args]
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self) -> "ServiceProcess":
        """Start the process (returns at once)."""
        out = open(self.log_path, "ab") if self.log_path else None
        try:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT if out else None,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if out:
                out.close()
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` once the port is known."""
        if self.port is None:
            raise RuntimeError(f"{self.role}: port not known yet; call wait_port() first")
        return f"127.0.0.1:{self.port}"

    @property
    def _log_hint(self) -> str:
        return f"log: {self.log_path}" if self.log_path else "its log is above"

    @property
    def metrics_port(self) -> int | None:
        """The bound Prometheus port once the service listens; None when it serves no metrics."""
        path = metrics_port_file(self.port_file)
        return int(path.read_text()) if path.exists() else None

    @property
    def http_port(self) -> int | None:
        """prepare's bound OpenAI-compatible HTTP port once it listens; None when it serves none."""
        from stageserve.prepare.openai_api import http_port_file

        path = http_port_file(self.port_file)
        return int(path.read_text()) if path.exists() else None

    def wait_port(self, timeout_s: float = 120.0) -> int:
        """Wait for the port file; returns the bound port.

        Raises:
            RuntimeError: the process exited first (its log path is named), or the timeout passed.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.port_file.exists():
                self.port = int(self.port_file.read_text())
                return self.port
            self._raise_if_exited()
            time.sleep(0.05)
        raise RuntimeError(f"{self.role} did not report its port within {timeout_s:.0f} s ({self._log_hint})")

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until the service's readiness (its full service name) is SERVING.

        Raises:
            RuntimeError: the process exited first, or the timeout passed.
        """
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with dial(self.address, self.tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=SERVICE_NAMES[self.role])
            while time.monotonic() < deadline:
                self._raise_if_exited()
                try:
                    if stub.Check(request, timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{self.role} was not ready within {timeout_s:.0f} s ({self._log_hint})")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit code (None if never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def _raise_if_exited(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.role} exited with code {self.process.returncode} ({self._log_hint})")


@dataclass
class Pipeline:
    """The three services of one local deployment."""

    device: ServiceProcess
    reclaim: ServiceProcess
    prepare: ServiceProcess

    @property
    def processes(self) -> list[ServiceProcess]:
        return [self.prepare, self.reclaim, self.device]

    def stop(self, timeout_s: float = 30.0 + STOP_MARGIN_S) -> dict[str, int | None]:
        """Stop prepare, the device, then reclaim, each SIGTERM then up to ``timeout_s`` before
        SIGKILL; returns each role's exit code.

        The order lets every drain complete: prepare finishes its requests and lets the device go;
        the device's last outputs are taken by reclaim, which is still up; reclaim has nothing left.
        """
        return {p.role: p.stop(timeout_s) for p in (self.prepare, self.device, self.reclaim)}


def start_pipeline(
    workdir: Path,
    device_args: list[str] = (),
    reclaim_args: list[str] = (),
    prepare_args: list[str] = (),
    ports: tuple[int, int, int] = (0, 0, 0),
    log_dir: Path | None = None,
    ready_timeout_s: float = 300.0,
    tls: TlsFiles | None = None,
) -> Pipeline:
    """Start device, reclaim and prepare; return once all three are ready.

    Args:
        ports: (prepare, device, reclaim) ports; 0 = ephemeral.
        log_dir: where each service's log goes (``ROLE.log``); None = inherit our stdout/stderr.
        tls: every service gets these ``--tls-cert``/``--tls-key``/``--tls-ca`` (one certificate
            for all three, valid for ``127.0.0.1``); readiness is checked over mutual TLS with them.
            None = plaintext.

    Raises:
        RuntimeError: a service exited or was not ready in time; every started process is stopped first.
    """
    def log(role: str) -> Path | None:
        return log_dir / f"{role}.log" if log_dir else None

    prepare_port, device_port, reclaim_port = ports
    tls_args = [] if tls is None else ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]
    started: list[ServiceProcess] = []
    try:
        device = ServiceProcess("device", [*tls_args, *device_args], workdir, device_port, log("device"), tls).start()
        started.append(device)
        device.wait_port(ready_timeout_s)
        reclaim = ServiceProcess("reclaim", ["--device", device.address, *tls_args, *reclaim_args], workdir, reclaim_port,
                                 log("reclaim"), tls).start()
        started.append(reclaim)
        reclaim.wait_port(ready_timeout_s)
        prepare = ServiceProcess(
            "prepare", ["--device", device.address, "--reclaim", reclaim.address, *tls_args, *prepare_args], workdir, prepare_port,
            log("prepare"), tls,
        ).start()
        started.append(prepare)
        prepare.wait_port(ready_timeout_s)
        for process in (device, reclaim, prepare):
            process.wait_ready(ready_timeout_s)
        return Pipeline(device=device, reclaim=reclaim, prepare=prepare)
    except BaseException:
        for process in reversed(started):
            process.stop(timeout_s=10)
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--port", type=int, default=50051, help="prepare's port (public API); 0 = ephemeral")
    parser.add_argument("--device-port", type=int, default=50052)
    parser.add_argument("--reclaim-port", type=int, default=50053)
    parser.add_argument("--http-port", default="8000", metavar="PORT|0|off",
                        help="prepare's OpenAI-compatible HTTP API (default %(default)s); 0 = ephemeral; off = none")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "npu"])
    parser.add_argument("--dispatch", default="async", choices=["async", "sync"])
    parser.add_argument("--pipeline-depth", type=int, default=2)
    parser.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS, help="the device's weight format (stageserve device --help)")
    parser.add_argument("--dense-copy", default="auto", choices=DENSE_COPY_MODES,
                        help="the device's dense copies of quantized linears (stageserve device --help)")
    parser.add_argument("--no-dense-copy", dest="dense_copy", action="store_const", const="none", help="the same as --dense-copy none")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                        help="the device's KV pool, e.g. 256MiB (default: the device's)")
    parser.add_argument("--speculative-method", default="none", choices=["none", "ngram", "draft", "mtp"], help="the device's speculative decoding (docs/speculative.md)")
    parser.add_argument("--draft-model", default="", metavar="PATH",
                        help="with --speculative-method draft: GGUF file or Hugging Face directory of a smaller model sharing --model's tokenizer")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K", help="drafts per decode row and step, with a --speculative-method")
    parser.add_argument("--speculative-policy", default="goodput", choices=SPECULATIVE_POLICIES,
                        help="goodput: drafts where the device's measured step costs say they pay; always: K on every row")
    parser.add_argument("--trace-dir", type=Path, default=None, metavar="DIR",
                        help="all three services record a Chrome trace from start-up into DIR, written at shutdown "
                             "(then: stageserve trace merge DIR)")
    parser.add_argument("--log-format", choices=["text", "json"], default="text", help="the services' log lines (default %(default)s)")
    parser.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                        help="the services' logs go to DIR/{device,reclaim,prepare}.log (default: a new folder in the "
                             "system's temporary folder, printed at start and kept)")
    parser.add_argument("--verbose", action="store_true", help="stream the services' logs to this terminal instead of files")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on Ctrl-C/SIGTERM, how long each service may finish its in-flight work (default %(default)s)")
    parser.add_argument("--metrics-port-base", default="9101", metavar="PORT|0|off",
                        help="Prometheus ports: prepare PORT, device PORT+1, reclaim PORT+2 (default %(default)s); "
                             "0 = ephemeral ports (printed once ready); off = no metrics")
    parser.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                        help="every service serves TLS with this certificate (valid for 127.0.0.1) and the three talk over"
                             " mutual TLS with it; needs --tls-key and --tls-ca (default: plaintext)")
    parser.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument("--tls-ca", type=Path, default=None, metavar="PEM", help="the CA bundle that signed --tls-cert")
    parser.add_argument("--api-keys-file", type=Path, default=None, metavar="PATH",
                        help="prepare's API keys (see stageserve prepare --help); default: none, the API is open")
    parser.add_argument("--api-key", default="", help="with --chat and --api-keys-file: the key to send")
    add_openai_arguments(parser)
    parser.add_argument("--chat", default="", help="once ready, stream the answer to this chat message")
    parser.add_argument("--once", action="store_true", help="with --chat: stop the services after the answer")


def _metrics_ports(base: str) -> tuple[str, str, str]:
    """``--metrics-port`` values for (prepare, device, reclaim) from ``--metrics-port-base``."""
    if base in ("0", "off"):
        return base, base, base
    if not base.isdigit():
        raise SystemExit(f"error: --metrics-port-base must be a port, 0 or off; got {base!r}")
    return str(int(base)), str(int(base) + 1), str(int(base) + 2)


def _service_args(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """The (device, reclaim, prepare) flags ``up``'s own flags give."""
    common = ["--log-format", args.log_format, "--drain-timeout", str(args.drain_timeout),
              *(["--model", args.model] if args.model else []), *(["--trace-dir", str(args.trace_dir)] if args.trace_dir else [])]
    prepare_metrics, device_metrics, reclaim_metrics = _metrics_ports(args.metrics_port_base)
    device = [*common, "--metrics-port", device_metrics, "--dtype", args.dtype, "--backend", args.backend, "--dispatch", args.dispatch,
              "--pipeline-depth", str(args.pipeline_depth), "--weights", args.weights, "--dense-copy", args.dense_copy,
              *(["--kv-cache-memory", str(args.kv_cache_memory)] if args.kv_cache_memory else []), "--speculative-method", args.speculative_method,
              "--num-speculative-tokens", str(args.num_speculative_tokens), "--speculative-policy", args.speculative_policy,
              *(["--draft-model", args.draft_model] if args.draft_model else [])]
    keys = ["--api-keys-file", str(args.api_keys_file)] if args.api_keys_file else []
    return (device, [*common, "--metrics-port", reclaim_metrics],
            [*common, "--metrics-port", prepare_metrics, "--http-port", args.http_port, *keys, *openai_argv(args)])


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    """``up``'s TLS files, ``None`` for plaintext. Raises SystemExit when only some are given."""
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise SystemExit("error: --tls-cert, --tls-key and --tls-ca go together (one certificate for all three services)")
    return TlsFiles(*given)


def _tell(line: str) -> None:
    """One launcher line on stderr; a terminal that hung up (SIGHUP) fails the write, which must not
    keep the services from being stopped."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _raise_keyboard_interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def _print_ready(pipeline: Pipeline, tls: TlsFiles | None) -> None:
    metrics = ", ".join(f"{p.role} http://127.0.0.1:{p.metrics_port}/metrics" for p in pipeline.processes if p.metrics_port)
    scheme, transport = ("https", f"-cacert {tls.ca}") if tls else ("http", "-plaintext")
    print(
        f"ready: prepare (Generation API) {pipeline.prepare.address}, device {pipeline.device.address}, "
        f"reclaim {pipeline.reclaim.address} ({'mutual TLS' if tls else 'plaintext'})\n"
        f"  metrics: {metrics or 'off'}\n"
        f"  OpenAI-compatible API: {f'{scheme}://127.0.0.1:{pipeline.prepare.http_port}/v1' if pipeline.prepare.http_port else 'off'}\n"
        f"  try: stageserve generate --target {pipeline.prepare.address}{f' --tls-ca {tls.ca}' if tls else ''} --chat \"Tell me a joke\"\n"
        f"       grpcurl {transport} {pipeline.prepare.address} list\n"
        "Ctrl-C stops all three.",
        file=sys.stderr, flush=True,
    )


def run(args: argparse.Namespace) -> int:
    """Start the three services, optionally stream one chat answer, serve until Ctrl-C, SIGTERM or
    SIGHUP (the terminal closed).

    Exit code: 0 after a clean stop, 1 when a service failed to start or exited on its own, 2 for
    flags that do not fit together, 130 when interrupted while starting.
    """
    from stageserve import client
    from stageserve.device.flags import speculative_flags_problem

    problem = speculative_flags_problem(args.speculative_method, args.draft_model)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    log_dir = None if args.verbose else (args.log_dir or Path(tempfile.mkdtemp(prefix="stageserve-up-")))
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    device_args, reclaim_args, prepare_args = _service_args(args)
    tls = _tls(args)
    # While starting, Ctrl-C, SIGTERM or a hang-up interrupts start_pipeline, which stops what it started.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_keyboard_interrupt)
    with tempfile.TemporaryDirectory(prefix="stageserve-up-ports-") as ports_dir:
        logs = f"; logs in {log_dir}/" if log_dir else ""
        print(f"starting device, reclaim and prepare (loading the model and warming up){logs}...", file=sys.stderr, flush=True)
        try:
            pipeline = start_pipeline(Path(ports_dir), device_args=device_args, reclaim_args=reclaim_args, prepare_args=prepare_args,
                                      ports=(args.port, args.device_port, args.reclaim_port), log_dir=log_dir, tls=tls)
        except KeyboardInterrupt:
            print("interrupted while starting; the services are stopped", file=sys.stderr)
            return 130
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        stop = StopRequest()
        stop.handle_signals()
        try:
            _print_ready(pipeline, tls)
            code = client.stream_chat(pipeline.prepare.address, args.chat, tls and tls.ca, args.api_key) if args.chat else 0
            if args.chat and args.once:
                return code
            while not stop.wait(0.5):
                exited = [p for p in pipeline.processes if p.process.poll() is not None]
                # A service that exits 0 drained on a stop signal: the terminal's Ctrl-C or hang-up
                # reaches the whole process group, and on a busy machine a service can finish
                # before this process has run its own handler. Any other exit is a failure.
                if exited and all(p.process.returncode == 0 for p in exited):
                    return code
                if exited:
                    print("error: a service exited; stopping the others", file=sys.stderr)
                    return 1
            return code
        finally:
            _tell(f"stopping prepare, device, reclaim (in-flight requests get up to {args.drain_timeout:g} s)...")
            codes = pipeline.stop(args.drain_timeout + STOP_MARGIN_S)
            _tell(f"stopped: {codes}")
