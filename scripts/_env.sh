# Shared by the quickstart scripts: a project venv with the CPU torch wheel pinned.
# On a GPU host, install your CUDA torch build first, or set TORCH_CONSTRAINT to a file
# that pins it (default: constraints/cpu.txt, torch==2.13.0 CPU).
# INSTALL_EXTRAS: the package extras to install (serve.sh: none; test.sh: dev).
# TORCH_INDEX: where the CPU build of torch comes from. PyPI's Linux torch wheels are CUDA
# builds (several GB with their nvidia-* dependencies); PyTorch's CPU index serves the CPU
# build. Skipped when torch is already installed, when pip's find-links hold a CPU torch
# wheel, with a TORCH_CONSTRAINT of your own, or with TORCH_INDEX set empty.
VENV="${VENV:-.venv}"
TORCH_CONSTRAINT="${TORCH_CONSTRAINT:-constraints/cpu.txt}"
TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
INSTALL_EXTRAS="${INSTALL_EXTRAS-dev}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi

# uv installs the same wheels as pip in about a third of the time (a cold `.[dev]` install
# on a 2-core host: 124 s with pip, 51 s with uv, bootstrapping uv included). uv does not
# read pip's configuration, so pip's find-links (where a local CPU torch wheel may lie) are
# handed to it. Byte-compiled at install: where PYTHONDONTWRITEBYTECODE is set (as on this
# project's machines) nothing would ever write the .pyc files, and every process of the
# suite (Ray workers, subprocesses) would compile torch, ray and transformers again.
_find_links() {
  "$VENV/bin/python" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p"
}
_install_with_uv() {
  "$VENV/bin/python" -m pip install --quiet uv >/dev/null 2>&1 || return 1
  local links=() link
  for link in $(_find_links); do
    links+=(--find-links "$link")
  done
  "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --compile-bytecode \
    "${links[@]}" -c "$TORCH_CONSTRAINT" "$@"
}
_cpu_torch_first() {  # the CPU build from PyTorch's index, before anything pulls in torch
  [ -n "$TORCH_INDEX" ] && [ "$TORCH_CONSTRAINT" = constraints/cpu.txt ] || return 0
  "$VENV/bin/python" -c "import torch" 2>/dev/null && return 0
  local link
  for link in $(_find_links); do
    compgen -G "$link/torch-*+cpu-*.whl" >/dev/null && return 0
  done
  echo "_env.sh: torch (CPU build) from $TORCH_INDEX" >&2
  _install_with_uv --index-url "$TORCH_INDEX" torch \
    || _install_with_pip --index-url "$TORCH_INDEX" torch
}
_install_with_pip() {
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -c "$TORCH_CONSTRAINT" "$@"
}
target=".${INSTALL_EXTRAS:+[$INSTALL_EXTRAS]}"
stamp="$VENV/.installed-$(echo "$target" | cat - pyproject.toml "$TORCH_CONSTRAINT" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  _cpu_torch_first
  _install_with_uv -e "$target" || {
    echo "_env.sh: uv could not install; installing with pip" >&2
    _install_with_pip -e "$target"
  }
  touch "$stamp"
fi
