from __future__ import annotations

import pytest
from transformers import BertConfig, BertModel

from tokenrouter_ray.engine.loader import load_causal_lm
from tokenrouter_ray.errors import ModelLoadError


def test_missing_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_causal_lm(str(tmp_path / "nowhere"))


def test_directory_without_a_model(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="cannot read a model config"):
        load_causal_lm(str(tmp_path))


def test_not_a_causal_lm(tmp_path) -> None:
    cfg = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    BertModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not a causal LM"):
        load_causal_lm(str(tmp_path))


def test_unknown_dtype(tiny_llama_dir) -> None:
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_causal_lm(tiny_llama_dir, dtype="float7")


def test_weights_load_straight_onto_the_device(tiny_llama_dir, monkeypatch) -> None:
    """No ``.to(device)`` after loading: the weights are placed while they are read (on a
    GPU, a 32B model never sits in host RAM first)."""
    import torch

    moved: list[tuple] = []
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        moved.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    model = load_causal_lm(tiny_llama_dir, "float32", "cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not [a for a in moved if a and isinstance(a[0], (str, torch.device))]
