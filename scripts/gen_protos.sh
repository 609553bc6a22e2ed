#!/usr/bin/env bash
# Generate the Python gRPC stubs (and .pyi type stubs) for every .proto into the shared package
# stageserve/v1/. The one place generated code comes from; run it after editing protos/.
#
# Also writes stageserve/v1/descriptors.binpb: the same files as a FileDescriptorSet WITH their
# source info (the proto comments), which the generated _pb2 modules leave out. Server reflection
# serves these (stageserve/reflection.py), so `grpcurl describe` shows every field's comment.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I protos \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  --include_source_info --descriptor_set_out=stageserve/v1/descriptors.binpb \
  protos/stageserve/v1/*.proto
