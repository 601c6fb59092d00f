#!/usr/bin/env bash
# Install everything the tests need into .venv (idempotent), build the demo model once
# (cached under $XDG_CACHE_HOME/tokenrouter-ray), and run the test suite.
# Extra arguments go to pytest. pytest's "no tests collected" (exit 5) fails this script.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
source scripts/_env.sh
# Debian's prometheus for the live dashboard test (it skips, saying why, where this fails).
if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get install -y -qq prometheus >/dev/null 2>&1 \
    || { timeout 600 apt-get update -qq && timeout 600 apt-get install -y -qq prometheus; } \
      >/dev/null 2>&1 \
    || echo "test.sh: could not install prometheus; the live dashboard test will skip" >&2
fi
# Debian's chromium for the trace viewer's headless-browser test (it skips, saying why,
# where this fails).
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get install -y -qq chromium >/dev/null 2>&1 \
    || { timeout 600 apt-get update -qq && timeout 600 apt-get install -y -qq chromium; } \
      >/dev/null 2>&1 \
    || echo "test.sh: could not install chromium; the trace viewer's browser test will skip" >&2
fi
echo "test.sh: environment ready ($((SECONDS - start)) s)" >&2
mark=$SECONDS
echo "test.sh: demo models (built once and cached; a first build takes minutes)" >&2
"$VENV/bin/tokenrouter-ray" prepare-demo --quiet >/dev/null
echo "test.sh: demo models ready ($((SECONDS - mark)) s)" >&2
exec "$VENV/bin/python" -m pytest "$@"
