#!/usr/bin/env bash
# Correctness tests and benchmarks on a CUDA machine with no network and no model file: the
# dependencies that its Python lacks come as wheels in .whl/ (py3.12), and the embedded model's shape
# as config + tokenizer in .gpu/smollm2-shape (made by `random_checkpoint.py --config-only`); the
# weights are drawn at random there (speed depends on shapes, not values). Results go to $OUT.
# Usage: bash benchmarks/cuda_run.sh [tests] [decode] [dispatch] [peers]   (default: all four)
set -uo pipefail
PARTS=" ${*:-tests decode dispatch peers} "
want() { [[ $PARTS == *" $1 "* ]]; }
OUT=${OUT:-/tmp/stageserve-cuda}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Without an install, the services' packages are found through links like the wheel's package-dir mapping.
for role in prepare device reclaim; do ln -sfn ../services/$role stageserve/$role; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, grpc, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'grpc', grpc.__version__, 'transformers', transformers.__version__, 'cpus', __import__('os').cpu_count())"

want tests && echo "== tests on cuda" && timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/device/test_accelerator_backend.py \
    tests/integration/test_accelerator_pipeline.py 2>&1 | tee "$OUT/tests.log" | tail -20

MODEL=/tmp/smollm2-random
python3 benchmarks/random_checkpoint.py --like .gpu/smollm2-shape --out $MODEL 2>&1 | tail -1

want decode && echo "== decode step" && timeout 200 python3 benchmarks/decode_step.py --device cuda --model $MODEL --dtype bfloat16 --batch 1 8 32 64 128 256 \
    --context 128 --steps 32 --repeats 3 2>&1 | grep -v Warning | tee "$OUT/decode_step.md"

want dispatch && echo "== async vs sync dispatch" && timeout 300 python3 -m stageserve bench compare-dispatch --backend cuda --model $MODEL --sim-step-ms 2 5 --streams 32 \
    --repeats 3 --out "$OUT" 2>&1 | grep -v -E "Warning|^\s*$|it/s|failed, " | tee "$OUT/dispatch.md"

want peers && echo "== peers (transformers on cuda)" && timeout 240 python3 -m stageserve bench compare-peers --backend cuda --model $MODEL --streams 32 --repeats 3 \
    --out "$OUT" 2>&1 | grep -v -E "Warning|it/s|failed, " | tee "$OUT/peers.md"
