"""The descriptor set that reflection serves (``stageserve/v1/descriptors.binpb``): it is what
``scripts/gen_protos.sh`` makes of ``protos/`` today, agrees with the generated stubs, and its
comments reach a reflection client."""

from __future__ import annotations

import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2  # noqa: F401 (registers the health file, served by every service)

from stageserve.reflection import DESCRIPTOR_SET, SourceInfoPool, documented_files
from stageserve.v1 import admin_pb2, common_pb2, device_pb2, prepare_pb2, reclaim_pb2  # noqa: F401 (register the files in the default pool)

PROTOS = Path(__file__).resolve().parents[3] / "protos"


def test_descriptor_set_is_regenerated_from_the_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    out = tmp_path / "descriptors.binpb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(PROTOS), "--include_source_info",
                    f"--descriptor_set_out={out}", *sorted(str(p) for p in (PROTOS / "stageserve" / "v1").glob("*.proto"))],
                   check=True, capture_output=True)
    committed = descriptor_pb2.FileDescriptorSet.FromString(files("stageserve.v1").joinpath(DESCRIPTOR_SET).read_bytes())
    assert descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()) == committed, \
        "stageserve/v1/descriptors.binpb is stale: run `make protos`"


def test_descriptor_set_matches_the_generated_stubs() -> None:
    for name, documented in documented_files().items():
        registered = descriptor_pb2.FileDescriptorProto()
        descriptor_pool.Default().FindFileByName(name).CopyToProto(registered)
        stripped = descriptor_pb2.FileDescriptorProto()
        stripped.CopyFrom(documented)
        stripped.ClearField("source_code_info")
        assert stripped == registered, f"{name}: the stubs and descriptors.binpb differ: run `make protos`"


def test_reflection_pool_answers_with_comments_and_keeps_other_files() -> None:
    pool = SourceInfoPool()
    served = descriptor_pb2.FileDescriptorProto()
    file = pool.FindFileContainingSymbol("stageserve.v1.GenerateRequest")
    file.CopyToProto(served)
    comments = [location.leading_comments for location in served.source_code_info.location]
    assert " Completion tokens at most. Default 256, capped by the model's context.\n" in comments
    assert [d.name for d in file.dependencies] == ["stageserve/v1/common.proto"]
    dependency = descriptor_pb2.FileDescriptorProto()
    file.dependencies[0].CopyToProto(dependency)
    assert dependency.source_code_info.location
    health = pool.FindFileContainingSymbol("grpc.health.v1.Health")  # not ours: served as registered
    assert health.name == "grpc_health/v1/health.proto" and not isinstance(health, type(file))
    assert pool.FindMessageTypeByName("stageserve.v1.GenerateRequest").full_name == "stageserve.v1.GenerateRequest"
