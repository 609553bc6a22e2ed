#!/usr/bin/env bash
# Tokens/s of the same load against two deployments side by side: plaintext without keys, and
# mutual TLS between all three services + TLS to the client + an API key (issue 19: within 3%).
# Runs alternate (plain, secure, plain, secure, ...) so that a busy machine slows both alike.
# Usage: bash benchmarks/secure_vs_plain.sh [REPEATS] [STREAMS] [REQUESTS] [OUTPUT_LEN]   (default 3 32 64 64)
# Run from the repository with its .venv active (the certificates are made with the `cryptography`
# package of the test extra). Ports 51051-51053 (plain) and 52051-52053 (secure), no HTTP, no metrics;
# one JSON report per run in $OUT (default: a new temporary folder); prints medians and secure/plain.
set -euo pipefail
REPEATS=${1:-3} STREAMS=${2:-32} REQUESTS=${3:-64} OUTPUT_LEN=${4:-64}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
KEY=$(python3 -c "import secrets; print(secrets.token_urlsafe(32))")
echo "$KEY bench" > "$OUT/api-keys"
python3 - "$OUT/tls" <<'EOF'
import sys
from pathlib import Path
from tests.security_certs import Authority
Authority.create("bench CA").issue(Path(sys.argv[1]), "stageserve")
EOF
TLS=(--tls-cert "$OUT/tls/stageserve.crt" --tls-key "$OUT/tls/stageserve.key" --tls-ca "$OUT/tls/ca.crt")
COMMON=(--http-port off --metrics-port-base off)
stageserve up --port 51051 --device-port 51052 --reclaim-port 51053 "${COMMON[@]}" > "$OUT/up-plain.log" 2>&1 &
PLAIN=$!
stageserve up --port 52051 --device-port 52052 --reclaim-port 52053 "${COMMON[@]}" "${TLS[@]}" \
    --api-keys-file "$OUT/api-keys" > "$OUT/up-secure.log" 2>&1 &
SECURE=$!
trap 'kill -TERM $PLAIN $SECURE; wait $PLAIN $SECURE' EXIT
for log in up-plain up-secure; do
    until grep -q "^ready:" "$OUT/$log.log"; do
        kill -0 $PLAIN && kill -0 $SECURE || { cat "$OUT"/up-*.log; exit 1; }
        sleep 1
    done
done
PLAIN_TARGET=(--target 127.0.0.1:51051)
SECURE_TARGET=(--target 127.0.0.1:52051 --tls-ca "$OUT/tls/ca.crt" --api-key "$KEY")
LOAD=(--streams "$STREAMS" --requests "$REQUESTS" --output-len "$OUTPUT_LEN" --no-progress)
WARM_UP=(--streams 2 --requests 4 --output-len 8 --no-progress)
stageserve bench "${PLAIN_TARGET[@]}" "${WARM_UP[@]}" > /dev/null
stageserve bench "${SECURE_TARGET[@]}" "${WARM_UP[@]}" > /dev/null
for i in $(seq "$REPEATS"); do
    stageserve bench "${PLAIN_TARGET[@]}" "${LOAD[@]}" --json "$OUT/plain-$i.json" > /dev/null
    stageserve bench "${SECURE_TARGET[@]}" "${LOAD[@]}" --json "$OUT/secure-$i.json" > /dev/null
done
python3 benchmarks/side_by_side.py "$OUT" plain secure
