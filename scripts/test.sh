#!/usr/bin/env bash
# Install everything the tests need into .venv (idempotent), lint (ruff check and
# ruff format --check, before anything slow), build the demo model once (cached under
# $XDG_CACHE_HOME/tokenrouter-ray), and run the test suite.
# Extra arguments go to pytest. pytest's "no tests collected" (exit 5) fails this script.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
source scripts/_env.sh
# Debian packages that some tests drive for real; each such test skips, saying why, where
# this fails: prometheus (the live dashboard test), chromium (the trace viewer's
# headless-browser test).
apt_install() {  # apt_install COMMAND WHAT-SKIPS
  if command -v "$1" >/dev/null || ! command -v apt-get >/dev/null; then return 0; fi
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get install -y -qq "$1" >/dev/null 2>&1 \
    || { timeout 600 apt-get update -qq && timeout 600 apt-get install -y -qq "$1"; } \
      >/dev/null 2>&1 \
    || echo "test.sh: could not install $1; $2 will skip" >&2
}
apt_install prometheus "the live dashboard test"
apt_install chromium "the trace viewer's browser test"
echo "test.sh: environment ready ($((SECONDS - start)) s)" >&2
bash scripts/lint.sh
mark=$SECONDS
echo "test.sh: demo models (built once and cached; a first build takes 10-25 minutes)" >&2
# Its progress goes to stderr; outside a terminal (CI logs) one line per 30 s per bar.
[ -t 2 ] || export TQDM_MININTERVAL="${TQDM_MININTERVAL:-30}"
"$VENV/bin/tokenrouter-ray" prepare-demo >/dev/null
echo "test.sh: demo models ready ($((SECONDS - mark)) s)" >&2
# Set order, dict-of-set iteration and anything else hash-seeded differ between processes
# unless the seed is fixed: pick one per run (or take the caller's) and print it, so a
# failure that depends on it reproduces with PYTHONHASHSEED=<seed> ./scripts/test.sh.
export PYTHONHASHSEED="${PYTHONHASHSEED:-$((RANDOM * 32768 + RANDOM))}"
echo "test.sh: PYTHONHASHSEED=$PYTHONHASHSEED" >&2
exec "$VENV/bin/python" -m pytest --durations=30 "$@"
