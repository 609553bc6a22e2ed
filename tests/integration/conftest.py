"""Fixtures that start the real services as processes on loopback (ephemeral ports) and stop them.

Every process is started through :func:`stageserve.launcher.start_pipeline`, exactly as
``stageserve up`` does, and stopped by pid (SIGTERM, then SIGKILL) even when a test fails. The
service logs land in pytest's temporary folder and are printed when a fixture fails to start.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from stageserve.launcher import Pipeline, start_pipeline
from stageserve.security.tls import TlsFiles
from stageserve.v1 import prepare_pb2_grpc

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# float32 so that greedy outputs do not depend on batch composition through bf16 rounding;
# a short context so that "max_tokens up to the remaining context" runs in seconds.
MAX_MODEL_LEN = 256
DEVICE_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256MiB"]


def launch(tmp_path_factory: pytest.TempPathFactory, name: str, device_args: list[str] = (), prepare_args: list[str] = (),
           reclaim_args: list[str] = (), tls: TlsFiles | None = None) -> Pipeline:
    """Start a pipeline whose logs go to a temporary folder named ``name`` (with ``tls``: over mutual TLS)."""
    return launch_in(tmp_path_factory.mktemp(name), device_args, prepare_args, reclaim_args, tls)


def launch_in(workdir: Path, device_args: list[str] = (), prepare_args: list[str] = (), reclaim_args: list[str] = (),
              tls: TlsFiles | None = None) -> Pipeline:
    """Start a pipeline whose logs go to ``workdir`` (pytest's folder factory is not thread-safe: make
    the folder first to start several pipelines side by side)."""
    try:
        return start_pipeline(workdir, device_args=[*DEVICE_ARGS, *device_args], prepare_args=list(prepare_args),
                              reclaim_args=list(reclaim_args), log_dir=workdir, tls=tls)
    except RuntimeError:
        for log in sorted(workdir.glob("*.log")):
            print(f"----- {log.name}\n{log.read_text()[-5000:]}")
        raise


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory: pytest.TempPathFactory):
    """The three services in async dispatch, shared by the tests that leave them healthy."""
    started = launch(tmp_path_factory, "pipeline-async")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def generation(pipeline: Pipeline):
    """A Generation stub on the shared pipeline's prepare service."""
    with grpc.insecure_channel(pipeline.prepare.address) as channel:
        yield prepare_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer, as the services load it (the reference for decoding)."""
    from stageserve.model_files import embedded_model_path
    from stageserve.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_path())
