"""The real demo model (SmolLM2-135M-Instruct) through the engine equals transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.request import SamplingParams

pytestmark = pytest.mark.demo


def test_demo_model_batched_greedy_equals_generate(demo_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    questions = ["What is the capital of France?", "Name a primary colour.", "Say hello."]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in questions
    ]
    engine = Engine.from_config(
        EngineConfig(model=demo_model_dir, memory_budget_bytes=2**30, block_size=16)
    )
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12))
    reference = AutoModelForCausalLM.from_pretrained(demo_model_dir).eval()
    for prompt, tokens in zip(prompts, outputs, strict=True):
        expected = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[
            0, len(prompt) :
        ].tolist()
        assert tokens == expected[: len(tokens)] and len(tokens) == len(expected)
    assert "Paris" in tokenizer.decode(outputs[0])
