#!/usr/bin/env bash
# The integration tests on a loaded machine: one core kept busy by another process while the tests
# run, ROUNDS times in a row (3 by default); stops at the first failing round. Run it before
# resolving anything that touches the services: CI machines have 2 cores, sometimes shared.
#
#   scripts/stress-tests.sh                                            # tests/integration, 3 rounds
#   ROUNDS=5 scripts/stress-tests.sh tests/integration/test_device_service.py -x
#
# Arguments go to pytest (default: tests/integration). Needs `make install` first (uses .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
[ $# -gt 0 ] || set -- tests/integration
.venv/bin/python -c 'while True: pass' &  # the busy core: a pure-Python spin takes one core whole
busy=$!
trap 'kill "$busy" 2>/dev/null || true' EXIT
for round in $(seq 1 "$rounds"); do
  echo "stress round $round of $rounds (one core busy: pid $busy): pytest $*"
  HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
done
echo "stress: $rounds rounds passed with one core busy"
