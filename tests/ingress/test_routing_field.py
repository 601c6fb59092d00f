"""The ``routing`` request extension end to end: the official ``openai`` client ->
the real FastAPI app over ASGI -> ``IngressServer`` -> two tiny real models
(``LocalRuntime``). A bad value is a 400 naming the field and leaves nothing behind; a
preset routes exactly as its configured threshold does; the config's presets reach the
request limits."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.openai.ingress_app import SERVED, served
from tests.tiny_models import chain_engines
from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.ingress.openai_server import request_limits_of
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.openai.validation import RequestLimits
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy

TWO = ["small", "large"]
PROMPT = [(7 * j) % 128 for j in range(9)]
PRESETS = {"high": (0.0,), "balanced": (0.45,), "fast": (1.0,)}


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def run_flow(dirs: dict[str, str], body: Any) -> Any:
    """The app over a runtime with the entropy policy (threshold 0.45) and ``PRESETS``;
    checks that no request, KV block or entry load is left afterwards."""
    tokenizer = AutoTokenizer.from_pretrained(dirs["small"])
    limits = RequestLimits(
        max_model_len=256, vocab_size=128, routing_presets=PRESETS, models=tuple(TWO)
    )

    async def go() -> Any:
        policy = build_policy("entropy", {"threshold": 0.45}, TWO)
        async with served(chain_engines(dirs, TWO), policy, tokenizer, limits=limits) as s:
            result = await body(s.client, s.http, s.runtime)
            await s.idle()
            return result

    return asyncio.run(go())


BAD = [
    ({"threshold": 1.5}, "routing.threshold"),
    ({"threshold": -0.01}, "routing.threshold"),
    ({"threshold": "high"}, "routing.threshold"),
    ({"threshold": True}, "routing.threshold"),
    ({"threshold": [0.2, 0.3]}, "routing.threshold"),  # entropy has one threshold
    ({"threshold": []}, "routing.threshold"),
    ({"quality": "ultra"}, "routing.quality"),
    ({"quality": 3}, "routing.quality"),
    ({"threshold": 0.2, "quality": "high"}, "routing"),
    ({}, "routing"),
    ({"treshold": 0.2}, "routing.treshold"),
    ("fast", "routing"),
    ({"model": "smal"}, "routing.model"),
    ({"model": "large", "quality": "high"}, "routing"),
    ({"model": "large", "max_large_share": 0.5}, "routing"),
    ({"max_large_share": 1.5}, "routing.max_large_share"),
    ({"max_large_share": -0.1}, "routing.max_large_share"),
    ({"max_large_share": "half"}, "routing.max_large_share"),
    ({"max_large_share": True}, "routing.max_large_share"),
]


def test_bad_routing_values_are_400s_naming_the_field(served_chain_dirs) -> None:
    async def body(client: Any, http: httpx.AsyncClient, runtime: LocalRuntime) -> None:
        good = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12, temperature=0)
        first = asyncio.ensure_future(good)  # runs while the bad ones are refused
        for routing, param in BAD:
            for create, extra in (
                (client.completions.create, {"prompt": PROMPT}),
                (client.chat.completions.create, {"messages": [{"role": "user", "content": "w1"}]}),
            ):
                with pytest.raises(openai.BadRequestError) as bad:
                    await create(
                        model=SERVED, max_tokens=4, extra_body={"routing": routing}, **extra
                    )
                assert bad.value.status_code == 400, routing
                assert bad.value.param == param, (routing, bad.value.body)
                assert bad.value.type == "invalid_request_error"
        for literal in ("NaN", "Infinity", "-Infinity"):  # what the openai client cannot send
            body = (
                f'{{"model": "{SERVED}", "prompt": [1, 2], "routing": {{"threshold": {literal}}}}}'
            )
            response = await http.post("/v1/completions", content=body.encode(),
                                       headers={"content-type": "application/json"})  # fmt: skip
            assert response.status_code == 400, literal
            assert response.json()["error"]["param"] == "routing.threshold"
        with pytest.raises(openai.BadRequestError) as unknown:
            await client.completions.create(
                model=SERVED, prompt=PROMPT, max_tokens=4, extra_body={"routing": {"quality": "x"}}
            )
        assert "'x'" in unknown.value.message and "balanced" in unknown.value.message
        got = await first  # the good request, unaffected by the refused ones around it
        plain = await runtime.complete(PROMPT, SamplingSpec(temperature=0.0, max_tokens=12, seed=0))
        assert ids_of(got.choices[0].text) == plain.token_ids

    run_flow(served_chain_dirs, body)


def test_a_preset_routes_as_its_configured_threshold(served_chain_dirs) -> None:
    async def body(client: Any, http: httpx.AsyncClient, runtime: LocalRuntime) -> None:
        async def counts(routing: dict[str, Any] | None) -> tuple[str, dict[str, int]]:
            extra = {} if routing is None else {"routing": routing}
            response = await client.completions.create(
                model=SERVED, prompt=PROMPT, max_tokens=16, temperature=0, seed=3, extra_body=extra
            )
            choice = response.choices[0]
            return choice.text, choice.model_extra["routing"]["tokens_per_model"]

        async def direct(thresholds: tuple[float, ...]) -> tuple[list[int], dict[str, int]]:
            spec = SamplingSpec(temperature=0.0, max_tokens=16, seed=3)
            done = await runtime.complete(PROMPT, spec, thresholds=thresholds)
            return done.token_ids, done.counts

        for name, thresholds in PRESETS.items():
            text, by_model = await counts({"quality": name})
            ids, want = await direct(thresholds)
            assert by_model == want and ids_of(text) == ids, name
            assert (await counts({"threshold": thresholds[0]}))[1] == want
        assert (await counts({"quality": "high"}))[1] == {"large": 16}  # 0: every token
        assert (await counts({"quality": "fast"}))[1] == {"small": 16}  # 1: none
        assert (await counts(None))[1] == (await counts({"quality": "balanced"}))[1]
        assert (await counts({"threshold": [0.0]}))[1] == {"large": 16}  # a list of one

    run_flow(served_chain_dirs, body)


def test_a_model_alone_and_a_capped_share_through_the_api(served_chain_dirs) -> None:
    """``routing.model`` serves the request by that model alone (mode ``alone``, no
    handoff); ``routing.max_large_share`` routes it as the runtime does with that cap."""

    async def body(client: Any, http: httpx.AsyncClient, runtime: LocalRuntime) -> None:
        async def ask(routing: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
            response = await client.completions.create(
                model=SERVED, prompt=PROMPT, max_tokens=16, temperature=0, seed=3,
                extra_body={"routing": routing},
            )  # fmt: skip
            choice = response.choices[0]
            return ids_of(choice.text), choice.model_extra["routing"]

        spec = SamplingSpec(temperature=0.0, max_tokens=16, seed=3)
        ids, routing = await ask({"model": "large"})
        assert routing == {
            "tokens_per_model": {"large": 16},
            "handoffs": 0,
            "mode": "alone",
            "reason": "request",
        }
        alone = await runtime.complete(PROMPT, spec, alone="large", thresholds=(0.0,))
        assert ids == alone.token_ids
        ids, routing = await ask({"quality": "high", "max_large_share": 0.25})
        capped = await runtime.complete(PROMPT, spec, max_share=0.25, thresholds=(0.0,))
        assert ids == capped.token_ids and routing["tokens_per_model"] == capped.counts
        assert routing["mode"] == "routed" and capped.counts["large"] <= 4
        assert (await ask({"quality": "high"}))[1]["tokens_per_model"] == {"large": 16}

    run_flow(served_chain_dirs, body)


def config(policy: dict[str, Any], models: int = 2) -> AppConfig:
    names = ["small", "mid", "large"][-models:] if models == 3 else TWO
    return AppConfig.model_validate({
        "models": {n: {"path": n} for n in names},
        "policy": policy,
        "ingress": {"generation_config": "none"},
    })  # fmt: skip


class _Info:
    max_model_len = 256
    vocab_size = 128


class _Tokenizer:
    def __len__(self) -> int:
        return 128


def test_config_presets_reach_the_request_limits() -> None:
    cfg = config({"name": "escalation", "options": {"thresholds": [0.3, 0.4]},
                  "presets": {"high": [0.1, 0.2], "fast": 0.9}}, models=3)  # fmt: skip
    limits = request_limits_of(cfg, _Tokenizer(), [_Info(), _Info(), _Info()])
    assert limits.routing_levels == 2
    assert limits.routing_presets == {"high": (0.1, 0.2), "fast": (0.9,)}
    plain = request_limits_of(config({"name": "entropy"}), _Tokenizer(), [_Info(), _Info()])
    assert (plain.routing_levels, plain.routing_presets) == (1, {})
    never = request_limits_of(config({"name": "never"}), _Tokenizer(), [_Info(), _Info()])
    assert never.routing_levels == 0


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        ({"name": "entropy", "presets": {"high": 1.5}}, "presets"),
        ({"name": "entropy", "presets": {"high": math.nan}}, "presets"),
        ({"name": "entropy", "presets": {"high": [0.1, 0.2]}}, "one"),
        ({"name": "never", "presets": {"high": 0.1}}, "no threshold"),
        ({"name": "entropy", "preset": {"high": 0.1}}, "preset"),
    ],
)
def test_bad_presets_are_config_errors(policy: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config(policy)
