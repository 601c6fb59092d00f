"""Structured outputs across models: ``LocalRuntime`` over tiny random-weight Qwen3 models
(byte-level vocabulary, so JSON is spellable) that hand each request back and forth. For
every policy, greedy and sampled, every output parses and validates against its JSON
schema although several models wrote it; handoffs happen (asserted); greedy output equals
the sequential reference with the grammar applied there too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import make_engine
from tests.openai.qwen3_tiny import VOCAB_SIZE, qwen3_tokenizer, save_qwen3_models
from tokenrouter_ray.engine.grammar import GrammarBook
from tokenrouter_ray.engine.request import GrammarSpec, SamplingParams
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.reference import reference_generate
from tokenrouter_ray.routing.policy import build_policy

TWO, THREE = ["small", "large"], ["small", "mid", "large"]
SPACE = 220  # the byte-level token of " " (GlimpRouter's step end here: after ", " / ": ")
# thresholds low enough that masked entropies (0 on forced tokens) still route
CASES = {
    "never": ({}, TWO),
    "always": ({}, TWO),
    "bernoulli": ({"p": 0.35}, TWO),
    "entropy": ({"threshold": 0.05}, TWO),
    "r2r": ({"threshold": 0.3}, TWO),  # routes on raw logits
    "citer": ({"threshold": 0.5}, TWO),
    "co_llm": ({"threshold": 0.5}, TWO),
    "rstitch": ({"tau": 0.05}, TWO),
    "glimprouter": ({"tau": 0.02, "step_end_token_ids": [SPACE]}, TWO),
    "escalation": ({"thresholds": [0.05, 0.04]}, THREE),
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
}
GRAMMAR = GrammarSpec("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 120
N = 6


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("qwen3chain"))
    return save_qwen3_models(root, THREE)


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_tokenizer()


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for i in range(N):
        messages = [{"role": "user", "content": f"A person as JSON, please ({i})"}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, enable_thinking=False
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run(policy, engines, batch, spec: SamplingSpec):
    async def go():
        async with LocalRuntime(engines, policy) as runtime:
            results = await asyncio.wait_for(runtime.complete_all(batch, spec), 300)
            await runtime.wait_idle()
            assert all(s.engine.kv.pool.num_free_blocks == s.engine.kv.pool.num_blocks
                       for s in runtime.model_replicas)  # fmt: skip
            return results

    return asyncio.run(go())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_output_validates_across_handoffs(name, temperature, qwen_dirs, tokenizer) -> None:
    options, names = CASES[name]
    policy = build_policy(name, options, names)
    engines = [(n, make_engine(qwen_dirs[n], num_blocks=512)) for n in names]
    spec = SamplingSpec(temperature=temperature, max_tokens=MAX_TOKENS, seed=7, grammar=GRAMMAR)
    results = run(policy, engines, prompts(tokenizer), spec)
    for got in results:
        assert got.error is None and got.finish_reason == "stop"
        text = tokenizer.decode(got.token_ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)  # 100 %: every one parses and validates
    handoffs = sum(r.handoffs for r in results)
    if name == "never":
        assert handoffs == 0
    else:
        assert handoffs >= N, f"{name}: too few handoffs to exercise the grammar ({handoffs})"
        writers = {m for r in results for m, c in r.counts.items() if c}
        # every model wrote constrained tokens ("always": the large one writes every token;
        # the small one's masked proposals are the ones it drops)
        assert len(writers) == (1 if name == "always" else len(names))
    if temperature:
        assert len({tuple(r.token_ids) for r in results}) > 1  # sampled: they differ


@pytest.mark.parametrize("name", ["bernoulli", "entropy", "r2r", "rstitch", "escalation"])
def test_greedy_equals_the_reference_with_the_grammar(name, qwen_dirs, tokenizer) -> None:
    options, names = CASES[name]
    policy = build_policy(name, options, names)
    engines = [(n, make_engine(qwen_dirs[n], num_blocks=512)) for n in names]
    spec = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, seed=7, grammar=GRAMMAR)
    batch = prompts(tokenizer)[:3]
    results = run(policy, engines, batch, spec)
    models = [
        (n, AutoModelForCausalLM.from_pretrained(qwen_dirs[n], dtype=torch.float64).eval())
        for n in names
    ]
    eos = [tokenizer.eos_token_id]
    books = {n: GrammarBook.for_tokenizer(tokenizer, VOCAB_SIZE, eos) for n in names}
    sampling = SamplingParams(max_tokens=MAX_TOKENS, grammar=GRAMMAR)
    for prompt, got in zip(batch, results, strict=True):
        want = reference_generate(models, policy, prompt, sampling, 7, books)
        assert got.token_ids == want.token_ids
        assert got.counts == want.counts and got.handoffs == want.handoffs
        assert got.finish_reason == want.finish_reason == "stop"
