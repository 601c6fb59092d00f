# Shared by the quickstart scripts: a project venv with the CPU torch wheel pinned.
# On a GPU host, install your CUDA torch build first, or set TORCH_CONSTRAINT to a file
# that pins it (default: constraints/cpu.txt, torch==2.13.0 CPU).
VENV="${VENV:-.venv}"
TORCH_CONSTRAINT="${TORCH_CONSTRAINT:-constraints/cpu.txt}"
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
_install_with_uv() {
  "$VENV/bin/python" -m pip install --quiet uv >/dev/null 2>&1 || return 1
  local links=() link
  for link in $("$VENV/bin/python" -m pip config list 2>/dev/null \
      | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p"); do
    links+=(--find-links "$link")
  done
  "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --compile-bytecode \
    "${links[@]}" -c "$TORCH_CONSTRAINT" "$@"
}
_install_with_pip() {
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -c "$TORCH_CONSTRAINT" "$@"
}
stamp="$VENV/.installed-$(cat pyproject.toml "$TORCH_CONSTRAINT" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  _install_with_uv -e '.[dev]' || {
    echo "_env.sh: uv could not install; installing with pip" >&2
    _install_with_pip -e '.[dev]'
  }
  touch "$stamp"
fi
