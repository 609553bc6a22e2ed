"""Peers run on the same machine, model file and prompt token ids, timed into the same `RequestRecord`s.

- **transformers**: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (the GGUF is
  dequantized to ``dtype``, as stageserve's device does; or an HF directory), on the same device
  as stageserve's (``--backend``), ``generate`` on a static batch (all
  requests of the batch start together, greedy, exactly ``max_tokens`` new tokens). A streamer
  timestamps every decoding step, so TTFT and ITL are per step as for stageserve.
- **llama-cpp-python** (``Llama`` API on the same GGUF, which llama.cpp computes in its own Q4_1
  format): one request at a time, as its server serves them; every request arrives at the start,
  so a request's TTFT includes the time it waited for those before it.

Both are optional (``pip install 'stageserve[bench]'``); nothing in the product imports this module.
"""

from __future__ import annotations

import time
from pathlib import Path

from stageserve.bench.metrics import RequestRecord
from stageserve.model_files import transformers_source


def transformers_static_batches(model_path: Path, dtype: str, prompts: list[list[int]], max_tokens: int, batch: int,
                                device: str = "cpu", threads: int | None = None) -> list[RequestRecord]:
    """Run ``prompts`` (token ids, equal lengths) in static batches of ``batch`` on ``device``; one record per prompt.

    Raises:
        ImportError: transformers is not installed.
        ValueError: the prompts do not all have the same length (a static batch needs no padding here).
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("transformers static batches need prompts of one length; use --input-len")
    if threads:
        torch.set_num_threads(threads)
    if device.startswith("npu"):
        import torch_npu  # noqa: F401 - registers the npu device type
    model = AutoModelForCausalLM.from_pretrained(**transformers_source(model_path), dtype=getattr(torch, dtype)).to(device).eval()

    class StepTimes(BaseStreamer):
        """Arrival time of each generated step (``put`` is called once with the prompt, then once per step)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value) -> None:  # generate hands over host copies: the step has finished
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self) -> None:
            pass

    def generate(ids: torch.Tensor, new_tokens: int, streamer: BaseStreamer | None = None) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0, streamer=streamer)

    generate(torch.tensor(prompts[:1], device=device), 2)  # warm-up
    records = []
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        streamer = StepTimes()
        sent = time.perf_counter()
        generate(torch.tensor(group, device=device), max_tokens, streamer)
        ended = time.perf_counter()
        for prompt in group:
            records.append(RequestRecord(sent_s=sent, chunks=[(t, 1) for t in streamer.times], ended_s=ended,
                                         prompt_tokens=len(prompt), completion_tokens=len(streamer.times)))
    return records


def llama_cpp_serial(model_path: Path, prompts: list[list[int]], max_tokens: int, threads: int | None = None) -> list[RequestRecord]:
    """Serve ``prompts`` one at a time with llama-cpp-python (greedy, exactly ``max_tokens`` tokens each).

    Raises:
        ImportError: llama-cpp-python is not installed (``pip install 'stageserve[bench]'``).
    """
    from llama_cpp import Llama

    context = max(len(p) for p in prompts) + max_tokens + 8
    llm = Llama(model_path=str(model_path), n_ctx=context, n_batch=512, n_threads=threads, verbose=False)

    def serve(prompt: list[int], record: RequestRecord) -> None:
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            record.chunks.append((time.perf_counter(), 1))
            if len(record.chunks) == max_tokens:
                break
        record.ended_s = time.perf_counter()
        record.prompt_tokens, record.completion_tokens = len(prompt), len(record.chunks)

    serve(prompts[0][:8], RequestRecord(sent_s=time.perf_counter()))  # warm-up
    arrived = time.perf_counter()
    records = [RequestRecord(sent_s=arrived) for _ in prompts]
    for prompt, record in zip(prompts, records):
        serve(prompt, record)
    return records
