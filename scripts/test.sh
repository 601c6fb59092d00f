#!/usr/bin/env bash
# Install everything the tests need into .venv (idempotent), build the demo model once
# (cached under $XDG_CACHE_HOME/tokenrouter-ray), and run the test suite.
# Extra arguments go to pytest. pytest's "no tests collected" (exit 5) fails this script.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
"$VENV/bin/tokenrouter-ray" prepare-demo --quiet >/dev/null
exec "$VENV/bin/python" -m pytest "$@"
