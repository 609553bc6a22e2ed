#!/usr/bin/env bash
# Generate the Python gRPC stubs (and .pyi type stubs) for every .proto into the shared package
# stageserve/v1/. The one place generated code comes from; run it after editing protos/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I protos \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/stageserve/v1/*.proto
