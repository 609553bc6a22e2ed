"""Ctrl-C on ``stageserve up`` in a pseudo-terminal, as a user presses it: idle and with a request in
flight; and the terminal closing under it (SIGHUP). Every child exits 0, a request in flight still gets all its tokens, and no
service waits out its drain timeout (each would log ``drain timeout``). The terminal shows the
launcher's lines only; the services' logs are in the folder it names.

``up`` runs on a tiny checkpoint (``tests.tiny_checkpoint``) so that each start takes seconds; the
two rounds run at once. A round that fails kills what it started, by pid. One round trip of each
kind is enough here: the 1-in-10 deadlock that once needed many rounds (a stop signal landing while
the waiter held a lock) is covered by ``tests/unit/shared/test_stop_signals.py``, 200 signals in
one process.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pexpect
import psutil
import pytest

from stageserve.v1 import common_pb2, prepare_pb2, prepare_pb2_grpc
from tests.tiny_checkpoint import write_tiny_checkpoint

ROUNDS = 2  # alternately idle and with a request in flight
DRAIN_TIMEOUT_S = 60
IN_FLIGHT_TOKENS = 48
READY = re.compile(r"ready: prepare \(Generation API\) (127\.0\.0\.1:\d+)")
STOPPED = re.compile(r"stopped: (\{.*\})")


@dataclass
class Round:
    exit_status: int | None
    codes: dict[str, int]
    logs: dict[str, str]
    streamed: prepare_pb2.GenerateStreamResponse | None
    streamed_tokens: int
    terminal: str  # what the launcher printed up to "ready"


def stream_until_done(address: str, first_chunk: threading.Event, out: list) -> None:
    """One greedy request of IN_FLIGHT_TOKENS tokens; sets ``first_chunk`` when the first one arrives."""
    request = prepare_pb2.GenerateRequest(prompt="count: 1 2 3", max_tokens=IN_FLIGHT_TOKENS, ignore_eos=True, temperature=0)
    tokens = 0
    try:
        with grpc.insecure_channel(address) as channel:
            for chunk in prepare_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=120):
                tokens += len(chunk.token_ids)
                first_chunk.set()
                out[:] = [chunk, tokens]
    finally:
        first_chunk.set()


def kill_tree(launcher: pexpect.spawn) -> None:
    """Kill the launcher's services and then the launcher, by pid (only on failure)."""
    try:
        children = psutil.Process(launcher.pid).children()
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        child.kill()
    launcher.terminate(force=True)


def one_round(model: Path, log_dir: Path, in_flight: bool) -> Round:
    launcher = pexpect.spawn(
        sys.executable,
        ["-m", "stageserve", "up", "--model", str(model), "--dtype", "float32", "--port", "0", "--device-port", "0",
         "--reclaim-port", "0", "--http-port", "0", "--metrics-port-base", "off", "--log-dir", str(log_dir), "--drain-timeout", str(DRAIN_TIMEOUT_S)],
        encoding="utf-8", timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        launcher.expect(READY)
        terminal = launcher.before
        address = launcher.match.group(1)
        launcher.expect("Ctrl-C stops all three.")
        streamed: list = [None, 0]
        client = None
        if in_flight:
            first_chunk = threading.Event()
            client = threading.Thread(target=stream_until_done, args=(address, first_chunk, streamed))
            client.start()
            first_chunk.wait(120)
        launcher.sendintr()  # the terminal's interrupt character: SIGINT to its foreground process group
        launcher.expect(STOPPED, timeout=3 * (DRAIN_TIMEOUT_S + 20))
        codes = ast.literal_eval(launcher.match.group(1))
        launcher.expect(pexpect.EOF)
        launcher.close()
        if client is not None:
            client.join(60)
        logs = {role: (log_dir / f"{role}.log").read_text() for role in ("prepare", "device", "reclaim")}
        return Round(launcher.exitstatus, codes, logs, streamed[0], streamed[1], terminal)
    except BaseException:
        kill_tree(launcher)
        raise


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_ctrl_c_stops_every_service_cleanly_idle_and_with_a_request_in_flight(tiny_model, tmp_path):
    with ThreadPoolExecutor(ROUNDS) as pool:
        futures = [pool.submit(one_round, tiny_model, tmp_path / f"round-{i}", i % 2 == 1) for i in range(ROUNDS)]
        rounds = [future.result() for future in futures]
    for index, result in enumerate(rounds):
        where = f"round {index} ({'request in flight' if index % 2 else 'idle'})"
        assert result.exit_status == 0, where
        assert result.codes == {"prepare": 0, "device": 0, "reclaim": 0}, where
        # Quiet by default: the launcher's own line names the log folder; no service line reaches the terminal.
        assert f"logs in {tmp_path / f'round-{index}'}/" in result.terminal, where
        assert " INFO " not in result.terminal and "listening on" not in result.terminal, where
        for role, log in result.logs.items():
            assert ": stopped" in log, f"{where}: {role} did not finish its shutdown"
            assert "drain timeout" not in log, f"{where}: {role} waited out its drain timeout"
        if index % 2:
            assert result.streamed is not None and result.streamed.finish_reason == common_pb2.FINISH_REASON_LENGTH, where
            assert result.streamed_tokens == IN_FLIGHT_TOKENS, where


def test_a_terminal_that_hangs_up_stops_every_service_cleanly(tiny_model, tmp_path):
    """Closing the terminal (its master side) sends ``up``, the session leader, SIGHUP, after which
    it can no longer write to the terminal: it still stops each service, which drains (its log
    says so), and exits 0."""
    launcher = pexpect.spawn(
        sys.executable,
        ["-m", "stageserve", "up", "--model", str(tiny_model), "--dtype", "float32", "--port", "0", "--device-port", "0",
         "--reclaim-port", "0", "--http-port", "0", "--metrics-port-base", "off", "--log-dir", str(tmp_path), "--drain-timeout", "10"],
        encoding="utf-8", timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    up = psutil.Process(launcher.pid)
    services: list[psutil.Process] = []
    try:
        launcher.expect("Ctrl-C stops all three.")
        services = up.children()
        assert len(services) == 3
        launcher.ptyproc.fileobj.close()  # the terminal goes away (not pexpect's close(), which signals the launcher itself)
        assert up.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(services, timeout=10)
        assert not alive
        for role in ("prepare", "device", "reclaim"):
            log = (tmp_path / f"{role}.log").read_text()
            assert ": stopped" in log and "drain timeout" not in log, role
    finally:
        for process in [*services, up]:
            if process.is_running():
                process.kill()
