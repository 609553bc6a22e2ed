#!/usr/bin/env bash
# The same load over prepare's gRPC API and over its OpenAI-compatible HTTP API, interleaved
# (grpc, http, grpc, http, ...) on one deployment, so that a busy machine slows both alike.
# Usage: bash benchmarks/http_vs_grpc.sh [REPEATS] [STREAMS] [REQUESTS] [OUTPUT_LEN]   (default 3 32 64 64)
# Starts `stageserve up` on ports 51051-51053 (HTTP 18000, no metrics), writes one JSON report per
# run to $OUT (default: a new temporary folder) and prints medians and HTTP/gRPC ratios, then the
# CPU seconds per run of prepare (its /proc/PID/stat) and of the load generator (/usr/bin/time).
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
PREPARE=$(pgrep -f "stageserve prepare --port 51051")
prepare_cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$PREPARE/stat"; }
run() {  # run NAME-I ARGS...: one bench run; appends "NAME prepare-CPU-s client-CPU-s" to $OUT/cpu.txt
    local name=$1 before; shift
    before=$(prepare_cpu_s)
    /usr/bin/time -f "%U %S" -o "$OUT/$name.time" stageserve bench "$@" "${LOAD[@]}" --json "$OUT/$name.json" > /dev/null
    echo "${name%-*} $(awk -v b="$before" -v a="$(prepare_cpu_s)" 'BEGIN {print a - b}') $(awk '{print $1 + $2}' "$OUT/$name.time")" >> "$OUT/cpu.txt"
}
for i in $(seq "$REPEATS"); do
    run "grpc-$i" --target 127.0.0.1:51051
    run "http-$i" --openai http://127.0.0.1:18000/v1
done
python3 "$(dirname "$0")/side_by_side.py" "$OUT" grpc http
echo "CPU seconds per run (prepare, load generator):"
sort "$OUT/cpu.txt" | awk '{printf "  %-5s prepare %5.2f  client %5.2f\n", $1, $2, $3}'
