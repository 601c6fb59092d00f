#!/usr/bin/env bash
# Install, build the demo model once, and serve the embedded CPU default.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
"$VENV/bin/tokenrouter-ray" prepare-demo
if [ -f conf/local.yaml ]; then
  exec "$VENV/bin/serve" run conf/local.yaml
fi
# The OpenAI server (conf/local.yaml) lands with issue #4; until then this runs the demo
# model through the engine and prints a streamed answer.
exec "$VENV/bin/tokenrouter-ray" generate "${@:-What is the capital of France?}"
