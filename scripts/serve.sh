#!/usr/bin/env bash
# Install, build the demo models once, and serve the embedded CPU default on :8000.
set -euo pipefail
cd "$(dirname "$0")/.."
INSTALL_EXTRAS=""  # serving needs the package alone, not the test tools
source scripts/_env.sh
"$VENV/bin/tokenrouter-ray" prepare-demo
exec "$VENV/bin/serve" run conf/local.yaml
