#!/usr/bin/env bash
# Correctness tests and benchmarks on a CUDA machine with no network and no model file, run from the
# repository root without installing it. Prepared where there is network:
#   .whl/  wheels (for that machine's Python) of what its environment lacks, e.g. `pip download
#          --no-deps --only-binary=:all: --python-version 3.12 -d .whl grpcio grpcio-health-checking
#          grpcio-reflection protobuf gguf` (optional: skipped when absent);
#   .gpu/smollm2-shape  the embedded model's config + tokenizer, from
#          `python benchmarks/random_checkpoint.py --out .gpu/smollm2-shape --config-only`;
# the weights are then drawn at random there (speed depends on shapes, not values).
# Usage: bash benchmarks/cuda_run.sh [tests] [decode] [dispatch] [peers]   (default: all four)
# Results go to $OUT (default: a new temporary folder); the exit status is 1 if a part failed.
set -uo pipefail
PARTS=" ${*:-tests decode dispatch peers} "
want() { [[ $PARTS == *" $1 "* ]]; }
WORK=$(mktemp -d)
OUT=${OUT:-$WORK/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:$WORK/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Without an install, the services' packages are found through links like the wheel's package-dir
# mapping; removed again at exit.
for role in prepare device reclaim; do ln -sfn ../services/$role stageserve/$role; done
trap 'rm -f stageserve/prepare stageserve/device stageserve/reclaim' EXIT
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, grpc, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'grpc', grpc.__version__, 'transformers', transformers.__version__, 'cpus', __import__('os').cpu_count())"

if want tests; then
    echo "== tests on cuda"
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/device/test_accelerator_backend.py \
        tests/integration/test_accelerator_pipeline.py > "$OUT/tests.log" 2>&1 || status=1
    tail -20 "$OUT/tests.log"
fi

MODEL=$WORK/smollm2-random
python3 benchmarks/random_checkpoint.py --like .gpu/smollm2-shape --out $MODEL 2>&1 | tail -1

if want decode; then
    echo "== decode step"
    timeout 200 python3 benchmarks/decode_step.py --device cuda --model $MODEL --dtype bfloat16 --batch 1 8 32 64 128 256 \
        --context 128 --steps 32 --repeats 3 2>&1 | grep -v Warning | tee "$OUT/decode_step.md" || status=1
fi

if want dispatch; then
    echo "== async vs sync dispatch"
    timeout 300 python3 -m stageserve bench compare-dispatch --backend cuda --model $MODEL --sim-step-ms 2 5 --streams 32 \
        --repeats 3 --out "$OUT" 2>&1 | grep -v -E "Warning|^\s*$|it/s|failed, " | tee "$OUT/dispatch.md" || status=1
fi

if want peers; then
    echo "== peers (transformers on cuda)"
    timeout 240 python3 -m stageserve bench compare-peers --backend cuda --model $MODEL --streams 32 --repeats 3 \
        --out "$OUT" 2>&1 | grep -v -E "Warning|it/s|failed, " | tee "$OUT/peers.md" || status=1
fi
exit $status
