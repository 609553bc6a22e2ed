"""Issue 33: how long a stream waits when its device or reclaim dies, now that prepare resumes it.

Two devices (float32, one torch thread each), reclaim and prepare on loopback; 8 greedy streams of
96 tokens. Fault 1: SIGKILL of the device holding the most streams mid-run; fault 2 (on the device
left): SIGKILL of reclaim, restarted at once on its port. For each stream, the gap from the kill
to its next chunk (after a device kill the streams of the other device go on at their usual pace:
the largest gaps are the resumed streams'), and every stream's tokens counted (each once) against
``max_tokens``.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/recovery_latency.py
"""

from __future__ import annotations

import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from stageserve.launcher import ServiceProcess
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc

DEVICE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--threads", "1", "--metrics-port", "0"]
STREAMS, MAX_TOKENS = 8, 96


def start(role: str, folder: Path, args: list[str], port: int = 0) -> ServiceProcess:
    folder.mkdir(exist_ok=True)
    process = ServiceProcess(role, args, folder, port, folder / f"{role}.log")
    process.start()
    process.wait_port()
    return process


def run_streams(stub) -> tuple[list[list[float]], list[int], list[threading.Thread]]:
    """Start the streams; each one's chunk arrival times (monotonic) and token count, filled as they run."""
    arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
    tokens = [0] * STREAMS

    def one(i: int) -> None:
        request = prepare_pb2.GenerateRequest(prompt=f"Story number {i}: once upon a time", max_tokens=MAX_TOKENS, ignore_eos=True,
                                              temperature=0.0, request_id=f"s{i}")
        for chunk in stub.GenerateStream(request, timeout=300):
            arrivals[i].append(time.monotonic())
            tokens[i] += len(chunk.token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    return arrivals, tokens, threads


def report(name: str, arrivals: list[list[float]], at: float, tokens: list[int]) -> None:
    """Each stream's ms from ``at`` to its first chunk after it (streams that had ended left out),
    sorted; the tokens each stream got."""
    waited = sorted(1000.0 * (after - at) for times in arrivals if (after := next((t for t in times if t > at), None)) is not None)
    print(f"{name}: first chunk after the kill, per stream (ms): {', '.join(f'{w:.0f}' for w in waited)};"
          f" p50 {statistics.median(waited):.0f}, max {max(waited):.0f}; tokens per stream {sorted(set(tokens))} (max_tokens {MAX_TOKENS})")


def main() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        root = Path(workdir)
        processes: list[ServiceProcess] = []
        try:
            devices = [start("device", root / f"device-{i}", DEVICE_ARGS) for i in range(2)]
            processes += devices
            for device in devices:
                device.wait_ready()
            endpoints = ",".join(device.address for device in devices)
            reclaim = start("reclaim", root / "reclaim", ["--device", endpoints])
            prepare = start("prepare", root / "prepare", ["--device", endpoints, "--reclaim", reclaim.address])
            processes += [reclaim, prepare]
            prepare.wait_ready()
            with grpc.insecure_channel(prepare.address) as channel:
                stub = prepare_pb2_grpc.GenerationStub(channel)

                def info() -> dict[str, prepare_pb2.DeviceStatus]:
                    return {d.address: d for d in stub.GetModelInfo(prepare_pb2.GetModelInfoRequest()).devices}

                while not all(d.accepting for d in info().values()):
                    time.sleep(0.1)
                # Fault 1: the device with the most streams.
                arrivals, tokens, threads = run_streams(stub)
                while sum(d.running_requests for d in info().values()) < STREAMS or min(map(len, arrivals)) < 8:
                    time.sleep(0.01)
                victim = max(devices, key=lambda d: info()[d.address].running_requests)
                print(f"streams on the device killed: {info()[victim.address].running_requests} of {STREAMS}")
                victim.process.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                for thread in threads:
                    thread.join()
                report("device SIGKILL", arrivals, killed_at, tokens)
                # Fault 2: reclaim, restarted on its port.
                arrivals, tokens, threads = run_streams(stub)
                while min(map(len, arrivals)) < 8:
                    time.sleep(0.01)
                reclaim.process.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                reclaim.process.wait(10)
                processes.append(start("reclaim", root / "reclaim-2", ["--device", endpoints], port=reclaim.port))
                for thread in threads:
                    thread.join()
                report("reclaim SIGKILL + restart", arrivals, killed_at, tokens)
        finally:
            for process in reversed(processes):
                process.stop()


if __name__ == "__main__":
    main()
