"""The demo's small model: construction on a tiny random Llama, the prompt split, and the
cached build of the real pair (loadable, same tokenizer, fewer layers, honest evaluation)."""

from __future__ import annotations

import dataclasses
import filecmp
import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
)

from tests.tiny_models import TINY as TINY_SHAPE
from tests.tiny_models import tiny_model
from tokenrouter_ray.demo.artifacts import Recipe, read_build_info
from tokenrouter_ray.demo.small import (
    TEMPLATES,
    TOPICS,
    Sample,
    chat_prompts,
    distill,
    make_small_model,
    split_topics,
    teacher_samples,
)

# The shared tiny shape, deeper (the small model is a prefix of its layers), tied as SmolLM2.
TINY = {**TINY_SHAPE, "num_hidden_layers": 5, "max_position_embeddings": 256}
TINY |= {"tie_word_embeddings": True}


@pytest.fixture(scope="module")
def tiny_large() -> LlamaForCausalLM:
    return tiny_model("llama", 0, **TINY).to(torch.float64)


def _layer_outputs(model: LlamaForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream after each decoder layer (before the final norm)."""
    outputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda mod, args, out: outputs.append(out))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return outputs


def test_small_model_copies_the_first_layers_exactly(tiny_large, tmp_path: Path) -> None:
    k = 3
    small = make_small_model(tiny_large, k)
    small.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert loaded.config.num_hidden_layers == k and type(loaded) is LlamaForCausalLM
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    ours, theirs = _layer_outputs(loaded, ids), _layer_outputs(tiny_large, ids)
    assert len(ours) == k
    for i in range(k):
        assert torch.equal(ours[i], theirs[i]), f"layer {i} differs"
    assert torch.equal(loaded.lm_head.weight, tiny_large.lm_head.weight)


def test_teacher_samples_tap_the_exit_states(tiny_large, tmp_path: Path) -> None:
    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine

    tiny_large.save_pretrained(tmp_path)
    engine = Engine.from_config(
        EngineConfig(model=str(tmp_path), dtype="float64", keep_logits=True, num_blocks=64,
                     block_size=4)
    )  # fmt: skip
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [3, 4, 5]]
    samples = teacher_samples(engine, prompts, max_tokens=6, top_k=8, exit_layer=2)
    assert not engine.has_unfinished and not engine.runner.taps  # tap removed
    for prompt, sample in zip(prompts, samples, strict=True):
        assert sample.prompt_ids == prompt and len(sample.output_ids) == 6
        assert sample.top_ids.shape == sample.top_logprobs.shape == (6, 8)
        assert sample.top_ids[:, 0].tolist() == sample.output_ids  # greedy = teacher's top-1
        assert bool((sample.top_logprobs <= 0).all())
        expected = _layer_outputs(tiny_large, torch.tensor([sample.input_ids]))[1][0]
        assert sample.exit_states.shape == expected.shape
        torch.testing.assert_close(sample.exit_states.double(), expected, atol=3e-2, rtol=2e-2)


def test_distill_trains_only_the_top_layers(tiny_large) -> None:
    k, m = 2, 2
    small = make_small_model(tiny_large, k + m).float()
    gen = torch.Generator().manual_seed(2)
    samples = []
    for _ in range(6):
        prompt = torch.randint(0, 128, (6,), generator=gen).tolist()
        output = torch.randint(0, 128, (5,), generator=gen).tolist()
        top = torch.randn(5, 128, generator=gen).log_softmax(-1).topk(8, dim=-1)
        sample = Sample(prompt, output, top.indices, top.values)
        states = _layer_outputs(small, torch.tensor([sample.input_ids]))[k - 1][0]
        sample.exit_states = states.to(torch.bfloat16)
        samples.append(sample)
    before = {n: p.detach().clone() for n, p in small.named_parameters()}
    recipe = Recipe(exit_layer=k, extra_layers=m, epochs=2, batch_seqs=2, top_k=8, negatives=16)
    losses = distill(small, samples, recipe)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    for name, p in small.named_parameters():
        layer = int(name.split(".")[2]) if ".layers." in name else None
        trained = (layer is not None and layer >= k) or name.startswith("model.norm")
        assert torch.equal(p, before[name]) != trained, name
        assert not p.requires_grad


def test_heldout_prompts_are_disjoint_from_training_prompts() -> None:
    train_topics, heldout_topics = split_topics(TOPICS, every=5)
    assert set(train_topics).isdisjoint(heldout_topics)
    assert sorted(train_topics + heldout_topics) == sorted(TOPICS)
    assert len(heldout_topics) == len(TOPICS[::5])
    train = chat_prompts(train_topics, 10_000, seed=0)
    heldout = chat_prompts(heldout_topics, 10_000, seed=1)
    assert len(set(train)) == len(train) and set(train).isdisjoint(heldout)
    from_heldout = {tpl.format(t=t) for tpl in TEMPLATES for t in heldout_topics}
    from_train = {tpl.format(t=t) for tpl in TEMPLATES for t in train_topics}
    assert from_heldout.isdisjoint(from_train)
    assert set(heldout) == from_heldout and set(train) == from_train
    assert chat_prompts(train_topics, 5, seed=0) == train[:5]  # seeded, prefix-stable


# --------------------------------------------------------------------- the real pair


@pytest.fixture(scope="module")
def demo_pair() -> tuple[Path, Path]:
    """(large, small) directories; builds the small model once if it is not cached."""
    from tokenrouter_ray.demo.large import prepare_demo
    from tokenrouter_ray.demo.small import prepare_small_model

    large = prepare_demo(quiet=True)
    return large, prepare_small_model(large, quiet=True)


@pytest.mark.demo
def test_demo_small_model_loads_and_shares_the_tokenizer(demo_pair) -> None:
    large_dir, small_dir = demo_pair
    small = AutoModelForCausalLM.from_pretrained(small_dir)
    large_cfg = AutoConfig.from_pretrained(large_dir)
    assert type(small) is LlamaForCausalLM
    assert small.config.num_hidden_layers < large_cfg.num_hidden_layers
    assert small.config.vocab_size == large_cfg.vocab_size
    assert filecmp.cmp(small_dir / "tokenizer.json", large_dir / "tokenizer.json", shallow=False)
    tok_small = AutoTokenizer.from_pretrained(small_dir)
    tok_large = AutoTokenizer.from_pretrained(large_dir)
    assert tok_small.get_vocab() == tok_large.get_vocab()
    text = "Explain gravity to a ten-year-old."
    assert tok_small(text)["input_ids"] == tok_large(text)["input_ids"]


@pytest.mark.demo
def test_demo_small_model_recorded_agreement_is_heldout(demo_pair) -> None:
    _, small_dir = demo_pair
    info = read_build_info(small_dir)
    assert info is not None
    recipe = Recipe(**info["recipe"])
    assert info["recipe"] == dataclasses.asdict(recipe)
    train_topics, heldout_topics = split_topics(TOPICS, recipe.heldout_every)
    assert info["train_topics"] == train_topics and info["heldout_topics"] == heldout_topics
    assert set(info["train_prompts"]).isdisjoint(info["heldout_prompts"])
    assert len(info["heldout_prompts"]) == recipe.eval_prompts
    from_heldout = {tpl.format(t=t) for tpl in TEMPLATES for t in heldout_topics}
    assert set(info["heldout_prompts"]) <= from_heldout
    assert info["heldout"]["tokens"] > 1000
    assert 0.0 < info["heldout"]["agreement"] <= 1.0


@pytest.mark.demo
def test_demo_small_model_agrees_with_the_large_model_on_heldout_prompts(demo_pair) -> None:
    """Re-measured, not read back: the large model answers the build's held-out prompts
    again, and the saved small model predicts those answers (teacher-forced) at least half
    of the time, as the build recorded."""
    from tokenrouter_ray.demo.small import agreement, encode_chat
    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine
    from tokenrouter_ray.engine.scheduler import SchedulerConfig

    large_dir, small_dir = demo_pair
    info = read_build_info(small_dir)
    recipe = Recipe(**info["recipe"])
    tokenizer = AutoTokenizer.from_pretrained(large_dir)
    prompts = [encode_chat(tokenizer, text) for text in info["heldout_prompts"]]
    engine = Engine.from_config(
        EngineConfig(
            model=str(large_dir),
            keep_logits=True,
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        )
    )
    samples = teacher_samples(engine, prompts, recipe.max_tokens, top_k=1)
    del engine
    small = AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32)
    measured = agreement(small, samples)
    recorded = info["heldout"]
    assert measured["tokens"] == pytest.approx(recorded["tokens"], rel=0.02)
    assert measured["agreement"] == pytest.approx(recorded["agreement"], abs=0.01)
    assert measured["agreement"] >= 0.50


@pytest.mark.demo
def test_demo_small_model_runs_in_the_engine(demo_pair) -> None:
    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine
    from tokenrouter_ray.engine.request import SamplingParams

    _, small_dir = demo_pair
    engine = Engine.from_config(EngineConfig(model=str(small_dir), memory_budget_bytes=2**30))
    tokenizer = AutoTokenizer.from_pretrained(small_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    [tokens] = engine.generate([prompt], SamplingParams(max_tokens=8))
    assert 1 <= len(tokens) <= 8


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ATEN_CPU_CAPABILITY": "avx2"}, "torch.float32"),  # what an AVX2-only host reports
        ({"TOKENROUTER_TRAIN_DTYPE": "fp32"}, "torch.float32"),
        ({"TOKENROUTER_TRAIN_DTYPE": "bf16", "ATEN_CPU_CAPABILITY": "avx2"}, "torch.bfloat16"),
    ],
)
def test_distillation_dtype_follows_the_cpu(env: dict, expected: str) -> None:
    """bf16 autocast only where the CPU computes bf16 natively: on an AVX2-only host it is
    emulated and a distillation step is ~10x slower than fp32 (the first run then ran past
    an hour). ATEN_CPU_CAPABILITY makes torch dispatch as such a host does."""
    import os
    import subprocess
    import sys

    code = "from tokenrouter_ray.demo.small import train_dtype; print(train_dtype())"
    clean = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY",)}
    clean.pop("TOKENROUTER_TRAIN_DTYPE", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == expected
