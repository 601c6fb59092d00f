#!/usr/bin/env bash
# Prepare .whl/: the wheels the GPU device image lacks, for its Python (3.12, x86-64), so
# `loadtest.gpu_check` runs there with nothing downloaded (the device has no network).
# The engine needs only pydantic beyond what that image holds (torch, transformers,
# safetensors, ...): pydantic, pydantic-core, annotated-types and typing-inspection, plus
# typing-extensions at least as new as pydantic wants. Versions are this venv's, so the
# device runs what the tests here ran. About 2.5 MB; .whl/ is git-ignored (info/exclude)
# and travels with `carry: [".whl"]`. The device command is in README.md ("On a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

pins=$("$PY" - <<'PY'
from importlib.metadata import version
names = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
rm -rf .whl
mkdir .whl
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
# shellcheck disable=SC2086  # $pins is a list of NAME==VERSION words
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl $pins
ls .whl
du -sh .whl
