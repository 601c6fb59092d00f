"""The served model's sampling defaults, from its ``generation_config.json``.

A model directory's ``generation_config.json`` enters `GenerationDefaults.from_model_dir`
(the ingress reads the entry model's at start-up); the values leave into
`validation._sampling`, which uses them for any sampling field a request omits, before
OpenAI's defaults, as vLLM does by default (its ``--generation-config auto``). The config
switch ``ingress.generation_config: none`` (vLLM: ``--generation-config vllm``) turns it off.

Read (vLLM's list): ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty``; a value outside the range a request may set is skipped. ``do_sample``
is not read (vLLM does not read it either).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenrouter_ray.engine.request import MAX_REPETITION_PENALTY

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults of one model; None: not set there (OpenAI's default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GenerationDefaults:
        """From a decoded generation_config.json; values of the wrong type are skipped."""

        def num(name: str, kind: type) -> Any:
            value = config.get(name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return kind(value) if ok and (kind is float or float(value).is_integer()) else None

        temperature = num("temperature", float)
        top_p = num("top_p", float)
        top_k = num("top_k", int)
        min_p = num("min_p", float)
        repetition = num("repetition_penalty", float)
        return cls(
            temperature=temperature if temperature is not None and 0 <= temperature <= 2 else None,
            top_p=top_p if top_p is not None and 0 < top_p <= 1 else None,
            top_k=top_k if top_k is not None and top_k >= 0 else None,
            min_p=min_p if min_p is not None and 0 <= min_p <= 1 else None,
            repetition_penalty=repetition
            if repetition is not None and 0 < repetition <= MAX_REPETITION_PENALTY
            else None,
        )

    @classmethod
    def from_model_dir(cls, path: str | Path | None) -> GenerationDefaults:
        """The defaults in ``path/generation_config.json``; none if it is absent or bad."""
        file = Path(path) / "generation_config.json" if path is not None else None
        if file is None or not file.is_file():
            return cls()
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("ignoring %s: %s", file, exc)
            return cls()
        return cls.from_config(config if isinstance(config, dict) else {})
