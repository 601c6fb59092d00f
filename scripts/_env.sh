# Shared by the quickstart scripts: a project venv with the CPU torch wheel pinned.
# On a GPU host, install your CUDA torch build first, or set TORCH_CONSTRAINT to a file
# that pins it (default: constraints/cpu.txt, torch==2.13.0 CPU).
VENV="${VENV:-.venv}"
TORCH_CONSTRAINT="${TORCH_CONSTRAINT:-constraints/cpu.txt}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
stamp="$VENV/.installed-$(cat pyproject.toml "$TORCH_CONSTRAINT" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  # Byte-compiled at install (no --no-compile): where PYTHONDONTWRITEBYTECODE is set (as on
  # this project's machines) nothing would ever write the .pyc files, and every process of
  # the suite (Ray workers, subprocesses) would compile torch, ray and transformers again.
  "$VENV/bin/python" -m pip install --quiet -c "$TORCH_CONSTRAINT" -e '.[dev]'
  touch "$stamp"
fi
