#!/usr/bin/env bash
# The same load over prepare's gRPC API and over its OpenAI-compatible HTTP API, interleaved
# (grpc, http, grpc, http, ...) on one deployment, so that a busy machine slows both alike.
# Usage: bash benchmarks/http_vs_grpc.sh [REPEATS] [STREAMS] [REQUESTS] [OUTPUT_LEN]   (default 3 32 64 64)
# Starts `stageserve up` on ports 51051-51053 (HTTP 18000, no metrics), writes one JSON report per
# run to $OUT (default: a new temporary folder) and prints medians and HTTP/gRPC ratios.
set -euo pipefail
REPEATS=${1:-3} STREAMS=${2:-32} REQUESTS=${3:-64} OUTPUT_LEN=${4:-64}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
stageserve up --port 51051 --device-port 51052 --reclaim-port 51053 --http-port 18000 --metrics-port-base off \
    > "$OUT/up.log" 2>&1 &
UP=$!
trap 'kill -TERM $UP; wait $UP' EXIT
until curl -sf http://127.0.0.1:18000/health > /dev/null; do
    kill -0 $UP || { cat "$OUT/up.log"; exit 1; }
    sleep 1
done
LOAD=(--streams "$STREAMS" --requests "$REQUESTS" --output-len "$OUTPUT_LEN" --no-progress)
stageserve bench --target 127.0.0.1:51051 --streams 4 --requests 8 --output-len 16 --no-progress > /dev/null  # warm-up
for i in $(seq "$REPEATS"); do
    stageserve bench --target 127.0.0.1:51051 "${LOAD[@]}" --json "$OUT/grpc-$i.json" > /dev/null
    stageserve bench --openai http://127.0.0.1:18000/v1 "${LOAD[@]}" --json "$OUT/http-$i.json" > /dev/null
done
python3 "$(dirname "$0")/side_by_side.py" "$OUT" grpc http
