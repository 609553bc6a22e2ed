"""llama.cpp's ``llama-server`` as a benchmark side: started on the same GGUF, loaded over HTTP.

The server is started with ``--parallel N`` (N slots, continuous batching) and a context of
``N * tokens_per_slot``; requests go to its native ``POST /completion`` with the prompt as token
ids (the workload's own ids, so both systems read the same prompt tokens), greedy,
``ignore_eos``, ``return_tokens`` and ``stream`` (``cache_prompt`` off unless asked: a load's prompts
are distinct, and the multi-turn chat turns it on), and every server-sent event is timed on arrival
(one event per token). The client is the standard library's ``http.client``, one blocking
connection per request on a worker thread, so the timing does not depend on an extra package.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from stageserve.bench.loadgen import StreamFailed
from stageserve.v1 import common_pb2, prepare_pb2


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (llama-server takes no port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """One ``llama-server`` process on ``model_path`` at ``127.0.0.1:port``; `stop` ends it by pid.
    ``extra_args``: more of its flags (its speculative decoding, for one).

    Raises:
        FileNotFoundError: ``binary`` does not exist.
        RuntimeError: the server exited or did not answer ``/health`` within ``ready_timeout_s``
            (the message carries the end of its log).
    """

    def __init__(self, binary: Path, model_path: Path, parallel: int, tokens_per_slot: int, log_path: Path,
                 threads: int | None = None, ready_timeout_s: float = 120.0, extra_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        command = [str(binary), "--model", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
                   "--parallel", str(parallel), "--ctx-size", str(parallel * tokens_per_slot), "--no-webui", *extra_args]
        if threads:
            command += ["--threads", str(threads)]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        try:
            self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        except FileNotFoundError:
            self._log.close()
            raise FileNotFoundError(f"--llama-server {binary}: no such program") from None
        try:
            self._wait_ready(ready_timeout_s)
        except RuntimeError:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.process.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not ready after {timeout_s:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-2000:].decode(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class CompletionTransport:
    """A load-generator transport (see `stageserve.bench.loadgen.Transport`) onto llama-server's streaming ``/completion``;
    ``cache_prompt``: let the server reuse the KV of a slot's previous prompt (llama-server's prompt cache)."""

    def __init__(self, port: int, cache_prompt: bool = False) -> None:
        self._port, self._cache_prompt = port, cache_prompt

    async def stream(self, request: prepare_pb2.GenerateRequest) -> AsyncIterator[tuple[float, prepare_pb2.GenerateStreamResponse]]:
        if not request.prompt_token_ids:
            raise ValueError("the llama-server side needs prompts as token ids: give --input-len")
        body = {"prompt": list(request.prompt_token_ids), "n_predict": request.max_tokens, "stream": True, "temperature": request.temperature,
                "top_k": 1 if request.temperature == 0 else 40, "ignore_eos": request.ignore_eos, "cache_prompt": self._cache_prompt, "return_tokens": True}
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        threading.Thread(target=self._read, args=(body, loop, events), daemon=True).start()
        while (item := await events.get()) is not None:
            if isinstance(item, StreamFailed):
                raise item
            yield item

    def _read(self, body: dict, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> None:
        """POST ``body`` and put ``(arrival, chunk)`` for every event on ``events``, then ``None``."""
        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the loop has closed: its reader stopped at a failure it was given
                pass

        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=600)
        try:
            connection.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status != 200:
                put(StreamFailed(f"HTTP_{reply.status}", reply.read()[:500].decode(errors="replace")))
                return
            while line := reply.readline():
                arrived = time.perf_counter()
                if line.startswith(b"data: "):
                    put((arrived, _chunk(json.loads(line[6:]))))
        except (OSError, http.client.HTTPException, ValueError) as exc:
            put(StreamFailed("UNAVAILABLE", f"{type(exc).__name__}: {exc}"))
        finally:
            connection.close()
            put(None)


def _chunk(event: dict) -> prepare_pb2.GenerateStreamResponse:
    """One llama-server stream event as the chunk a stageserve stream would send."""
    tokens = event.get("tokens") or ([0] if event.get("content") else [])
    chunk = prepare_pb2.GenerateStreamResponse(text=event.get("content", ""), token_ids=tokens)
    if event.get("stop"):
        chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH if event.get("stop_type") == "limit" else common_pb2.FINISH_REASON_STOP
        chunk.usage.prompt_tokens, chunk.usage.completion_tokens = event.get("tokens_evaluated", 0), event.get("tokens_predicted", 0)
    return chunk
