"""Where the demo's artifacts live: one cache directory, shared by every build step.

``$TOKENROUTER_CACHE``, else ``$XDG_CACHE_HOME/tokenrouter-ray``, else
``~/.cache/tokenrouter-ray``. This module imports nothing heavy, so the config layer and
the CLI can ask whether something is built without loading torch.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    if os.environ.get("TOKENROUTER_CACHE"):
        return Path(os.environ["TOKENROUTER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenrouter-ray"


def demo_model_dir() -> Path:
    return cache_dir() / DEMO_NAME


def is_prepared(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
