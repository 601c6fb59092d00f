#!/usr/bin/env bash
# ruff lint and format check over the tree (pyproject.toml [tool.ruff]); fails on the first
# finding. scripts/test.sh and scripts/test_fast.sh run it before any test. To fix:
#   .venv/bin/ruff check --fix . && .venv/bin/ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF="${VENV:-.venv}/bin/ruff"
"$RUFF" check --quiet .
"$RUFF" format --check --quiet .
echo "lint.sh: ruff check and ruff format --check passed" >&2
