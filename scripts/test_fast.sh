#!/usr/bin/env bash
# The fast tier for development: lint, then every test that starts no Ray, needs no demo
# build and is not marked slow (markers: pyproject.toml; `ray` and `demo` are applied by
# tests/conftest.py from the fixtures a test uses). It never builds the demo models.
# CI and the README's test command run the full suite: scripts/test.sh.
# Extra arguments go to pytest (e.g. `-x`, a path, `-k name`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
bash scripts/lint.sh
exec "$VENV/bin/python" -m pytest -m "not ray and not demo and not slow" "$@"
