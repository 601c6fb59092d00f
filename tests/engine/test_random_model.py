"""The one random-weight model factory (engine/random_model.py): seeded, drawn where and in
what it is asked, stored for the engine's own loader, and the windowed variants carry
their window, caps and bent scores."""

from __future__ import annotations

import torch

from tests.tiny_models import TINY
from tokenrouter_ray.engine.loader import load_causal_lm
from tokenrouter_ray.engine.random_model import (
    WINDOW,
    random_causal_lm,
    save_random_model,
    save_windowed,
)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict()


def test_the_seed_decides_the_weights() -> None:
    a, b, c = (random_causal_lm("llama", seed, **TINY) for seed in (1, 1, 2))
    assert all(torch.equal(t, weights(b)[k]) for k, t in weights(a).items())
    assert not torch.equal(weights(a)["lm_head.weight"], weights(c)["lm_head.weight"])
    assert not a.training


def test_drawn_in_the_dtype_asked_and_the_default_dtype_restored() -> None:
    model = random_causal_lm("qwen3", 0, device="cpu", dtype=torch.bfloat16, **TINY, head_dim=16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in random_causal_lm("Qwen3", 0, **TINY).parameters()} == {torch.float32}


def test_saved_in_the_dtype_asked_and_loadable(tmp_path) -> None:
    path = save_random_model(tmp_path / "m", "llama", torch.float64, 3, **TINY)
    drawn = random_causal_lm("llama", 3, **TINY)
    loaded = load_causal_lm(path, "float64", "cpu")
    assert loaded.lm_head.weight.dtype == torch.float64
    assert torch.equal(loaded.lm_head.weight, drawn.lm_head.weight.double())


def test_windowed_variants(tmp_path) -> None:
    mistral = load_causal_lm(save_windowed(tmp_path / "m", "mistral", seed=3, **TINY), "float32")
    assert mistral.config.sliding_window == WINDOW
    path = save_windowed(tmp_path / "g", "gemma2", seed=4, **TINY, head_dim=16)
    gemma = load_causal_lm(path, "float32")
    assert gemma.config.attn_logit_softcapping == 2.0
    assert gemma.config.final_logit_softcapping == 5.0
    plain = random_causal_lm("gemma2", 4, **TINY, head_dim=16)  # same draw, not bent
    q = gemma.model.layers[0].self_attn.q_proj.weight
    assert torch.allclose(q, 40 * plain.model.layers[0].self_attn.q_proj.weight)
