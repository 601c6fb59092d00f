#!/usr/bin/env bash
# Install everything the tests need into .venv (idempotent), build the demo model once
# (cached under $XDG_CACHE_HOME/tokenrouter-ray), and run the test suite.
# Extra arguments go to pytest. pytest's "no tests collected" (exit 5) fails this script.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
source scripts/_env.sh
echo "test.sh: environment ready ($((SECONDS - start)) s)" >&2
mark=$SECONDS
echo "test.sh: demo models (built once and cached; a first build takes minutes)" >&2
"$VENV/bin/tokenrouter-ray" prepare-demo --quiet >/dev/null
echo "test.sh: demo models ready ($((SECONDS - mark)) s)" >&2
exec "$VENV/bin/python" -m pytest "$@"
