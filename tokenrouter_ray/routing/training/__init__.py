"""Router training from data the models themselves generate (``tokenrouter-ray train-router``).

``data``: prompts, the large model's continuations, teacher-forced features and labels.
``train``: the training loop, held-out metrics and the ``train_router`` pipeline.
``commands``: the CLI. See docs/user-guide/router-training.md.

``train_router`` and ``TrainOptions`` are imported lazily: importing this package (as the
CLI parser does) costs no torch/transformers import.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TrainOptions", "train_router"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("tokenrouter_ray.routing.training.train"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
