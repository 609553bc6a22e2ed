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
python3 - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def runs(api):
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{api}-*.json"))]
def median(reports, *keys):
    values = []
    for report in reports:
        for key in keys:
            report = report[key]
        values.append(report)
    return statistics.median(values)
grpc, http = runs("grpc"), runs("http")
print(f"{len(grpc)} runs each; medians; raw reports in {out}")
print(f"{'':24}{'gRPC':>10}{'HTTP':>10}{'HTTP/gRPC':>11}")
for label, keys in (("output tokens/s", ("output_tokens_per_s",)), ("TTFT p50 ms", ("ttft_ms", "p50")),
                    ("TTFT p99 ms", ("ttft_ms", "p99")), ("e2e p50 ms", ("e2e_ms", "p50"))):
    g, h = median(grpc, *keys), median(http, *keys)
    print(f"{label:24}{g:>10.1f}{h:>10.1f}{h / g:>11.3f}")
failed = sum(r["requests"]["failed"] for r in grpc + http)
print(f"failed requests: {failed}")
EOF
