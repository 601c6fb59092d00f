#!/usr/bin/env bash
# Prepare .whl/: the wheels the GPU device image lacks, for its Python (3.12, x86-64,
# manylinux), so `loadtest.device.gpu_check` imports there with nothing downloaded (the device has
# no network). The image (loadtest/device/image_packages_*.txt, a dated copy of its list)
# holds torch, transformers, numpy, safetensors, ... but not msgspec (engine/request.py's
# sampling struct) nor pydantic (engine/engine.py's EngineConfig) and its companions;
# typing-extensions comes too, as new as pydantic-core wants (the image's may be older);
# xgrammar and its apache-tvm-ffi (engine/grammar.py's structured outputs, imported on
# first use; triton, its other dependency, is on the image).
# Versions are exact, the venv's the tests here ran with; tests/engine/
# test_gpu_check_imports.py fails when gpu_check imports anything neither the image nor
# this list provides, or when a pin drifts from the venv. 7.4 MB (du -sh of .whl/ on
# 2026-12-04; 7,731,624 bytes); .whl/ is git-ignored (info/exclude) and travels with
# `carry: [".whl"]`. The device command: README.md, "On a GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=(
    msgspec==0.23.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    xgrammar==0.2.9
    apache-tvm-ffi==0.1.15.post2
)
PY=${PYTHON:-.venv/bin/python}  # any Python with pip; it only downloads
[ -x "$PY" ] || PY=python3
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

rm -rf .whl
mkdir .whl
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" -d .whl "${PINS[@]}"
count=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#PINS[@]}" ]; then
    echo "expected ${#PINS[@]} wheels in .whl/, got $count" >&2
    exit 1
fi
ls .whl
du -sh .whl
