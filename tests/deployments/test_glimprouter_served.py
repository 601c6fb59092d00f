"""GlimpRouter served with its shipped config (conf/policy/glimprouter.yaml: no step-end ids,
so the policy reads them off the tokenizer). The app builder and every model replica must
build it with the tokenizer (``Policy.needs_tokenizer``); before that, ``build_app`` refused
the shipped config and GlimpRouter could not be served."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from tests.deployments.conftest import tiny_overrides
from tests.tiny_models import TINY_CHAT_TEMPLATE, chain_engines, save_chain_model
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.glimprouter import GlimpRouter, blank_line_tokens
from tokenrouter_ray.routing.policy import build_policy, policy_class

TWO = ["small", "large"]
STEP_ENDS = set(range(0, 128, 3))  # these tokens' text ends a paragraph


def save_paragraph_tokenizer(path: Path) -> None:
    """Word-level over the tiny models' 128 ids: token i is ``w{i}``, or ``p{i}`` followed by
    a blank line for the step-end ids (so GlimpRouter finds its step ends in the vocab)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {i: f"p{i}\n\n" if i in STEP_ENDS else f"w{i}" for i in range(128)}
    tok = Tokenizer(WordLevel({w: i for i, w in words.items()} | {"<unk>": 128}, "<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def glimp_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("glimp")
    dirs = {}
    for name, layers, seed in (("small", 1, 11), ("large", 3, 13)):
        dirs[name] = save_chain_model(root / name, layers, seed)
        save_paragraph_tokenizer(root / name)
    return dirs


def prompts() -> list[list[int]]:
    return [[(7 * i + j) % 128 for j in range(3 + 2 * i)] for i in range(4)]


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def test_policy_declares_it_needs_the_tokenizer(glimp_dirs) -> None:
    from transformers import AutoTokenizer

    assert policy_class("glimprouter").needs_tokenizer
    assert not policy_class("r2r").needs_tokenizer
    tokenizer = AutoTokenizer.from_pretrained(glimp_dirs["small"])
    assert set(blank_line_tokens(tokenizer)) == STEP_ENDS
    with pytest.raises(ValueError, match="needs step_end_token_ids or a tokenizer"):
        build_policy("glimprouter", {}, TWO)


def test_glimprouter_served_with_its_shipped_config(serve_http, glimp_dirs) -> None:
    from ray import serve
    from transformers import AutoTokenizer

    from deployments.app import build_app

    overrides = tiny_overrides(glimp_dirs, TWO, "glimprouter", "zmq_ipc")
    app = build_app({"overrides": overrides})  # raised ConfigError before needs_tokenizer
    tokenizer = AutoTokenizer.from_pretrained(glimp_dirs["small"])
    policy = build_policy("glimprouter", {"tau": 0.3}, TWO, tokenizer)  # the shipped options
    assert isinstance(policy, GlimpRouter)

    async def local() -> list:
        async with LocalRuntime(chain_engines(glimp_dirs, TWO), policy) as runtime:
            spec = SamplingSpec(temperature=0.0, max_tokens=16, seed=0)
            return await runtime.complete_all(prompts(), spec)

    expected = asyncio.run(local())
    serve.run(app, name="glimp", route_prefix="/glimp", blocking=False)
    try:
        client = openai.OpenAI(base_url=f"{serve_http}/glimp/v1", api_key="none", max_retries=0)
        got = [
            client.completions.create(model="tokenrouter", prompt=p, max_tokens=16, temperature=0)
            for p in prompts()
        ]
    finally:
        serve.delete("glimp")
    for want, response in zip(expected, got, strict=True):
        assert ids_of(response.choices[0].text) == want.token_ids
        assert response.model_extra["routing"]["tokens_per_model"] == want.counts
    # both models wrote, and the large model handed steps back: routing really ran
    assert sum(w.handoffs for w in expected) >= 20
    assert any(w.counts.get("small") and w.counts.get("large") for w in expected)
