"""Served greedy output equals the sequential reference, for what users run.

The three-model escalation chain (small -> mid -> large) is served over each transport
(ZeroMQ ipc and tcp, unix datagrams, Ray; the four apps deployed side by side) and called
with the official ``openai`` client, streamed and not, with the configured thresholds, a
request's own thresholds and a cap on the large model's share. Every answer must equal,
token for token and model for model, a reference that runs one request at a time with a
full-context forward per token: ``escalate_by_definition`` below is written from the
policy's definition alone (it shares no sampler, policy or engine code with the server); the
capped request, whose rule is the runtime's ``capped_dst``, is checked against
``tokenrouter_ray.reference``.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest

from tests.deployments.conftest import tiny_overrides, wait_running
from tests.deployments.test_serve_app import ids_of, prompts

CHAIN = ["small", "mid", "large"]
TAU = (0.3, 0.4)  # conf/policy/escalation.yaml
MAX_TOKENS = 24
MARGIN = 1e-4  # no decision may sit this close to its threshold (dtype-independent outcome)


@dataclass
class Answer:
    token_ids: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    handoffs: int = 0


def escalate_by_definition(models: dict, taus, prompt: list[int], max_tokens: int) -> Answer:
    """Escalation over a chain, greedy, from its definition: at level l below the top, if the
    normalized entropy of level l's next-token distribution exceeds tau_l the token is
    dropped and level l + 1 writes that position; otherwise the token is committed and the
    request returns to level 0. The top level commits and returns to level 0. Every change
    of the writing model is one handoff; a request that ends stays where it is."""
    import torch

    names = list(models)
    taus = [taus] * (len(names) - 1) if isinstance(taus, float) else list(taus)
    taus += [taus[-1]] * (len(names) - 1 - len(taus))
    sequence, answer, level = list(prompt), Answer(), 0
    with torch.inference_mode():
        while len(answer.token_ids) < max_tokens:
            logits = models[names[level]](torch.tensor([sequence])).logits[0, -1].double()
            token = int(logits.argmax())
            top_two = logits.topk(2).values
            assert top_two[0] - top_two[1] > MARGIN, "a near tie: the reference cannot decide"
            nxt = 0
            if level < len(names) - 1:
                logp = logits.log_softmax(-1)
                entropy = float(-(logp.exp() * logp).sum() / math.log(logits.numel()))
                assert abs(entropy - taus[level]) > MARGIN, (entropy, taus[level])
                if entropy > taus[level]:
                    nxt = level + 1
            if nxt > level:  # dropped; the next level writes this position
                answer.handoffs += 1
                level = nxt
                continue
            sequence.append(token)
            answer.token_ids.append(token)
            answer.counts[names[level]] = answer.counts.get(names[level], 0) + 1
            if level and len(answer.token_ids) < max_tokens:  # the last token ends it there
                answer.handoffs += 1
                level = 0
    return answer


# (prompt index, the request's `routing`, streamed)
REQUESTS = [
    (0, None, False),
    (1, None, True),
    (2, None, False),
    (3, {"threshold": [0.5, 0.45]}, False),
    (4, {"threshold": [0.5, 0.45]}, True),
    (5, {"threshold": 0.45}, False),
    (6, {"max_large_share": 0.25}, False),
    (7, {"max_large_share": 0.25}, True),
]


@pytest.fixture(scope="module")
def chain_models(served_chain_dirs) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(
            served_chain_dirs[name], dtype=torch.float64
        ).eval()
        for name in CHAIN
    }


@pytest.fixture(scope="module")
def references(chain_models) -> list[Answer]:
    from tokenrouter_ray.engine.request import SamplingParams
    from tokenrouter_ray.reference import reference_generate
    from tokenrouter_ray.routing.policy import build_policy

    models = chain_models
    policy = build_policy("escalation", {"thresholds": list(TAU)}, CHAIN)
    out = []
    for index, routing, _ in REQUESTS:
        prompt = prompts()[index]
        if routing and "max_large_share" in routing:
            ref = reference_generate(
                list(models.items()), policy, prompt,
                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), seed=0,
                max_share=routing["max_large_share"],
            )  # fmt: skip
            out.append(Answer(ref.token_ids, ref.counts, ref.handoffs))
        else:
            taus = routing["threshold"] if routing else TAU
            out.append(escalate_by_definition(models, taus, prompt, MAX_TOKENS))
    return out


def test_the_reference_covers_every_level_and_the_cap_binds(references, chain_models) -> None:
    """The comparison below is about real routing: every model writes, requests move often,
    a request's own thresholds change its answer, and the cap holds the large share down."""
    total = {name: sum(a.counts.get(name, 0) for a in references) for name in CHAIN}
    assert all(total[name] > 10 for name in CHAIN), total
    assert sum(a.handoffs for a in references) > 40
    for i, (index, routing, _) in enumerate(REQUESTS):
        if routing is None:
            continue
        default = escalate_by_definition(chain_models, TAU, prompts()[index], MAX_TOKENS)
        assert (references[i].token_ids, references[i].counts) != (
            default.token_ids,
            default.counts,
        ), f"the request's own routing {routing} changes nothing on prompt {index}"
        if "max_large_share" in routing:
            assert references[i].counts.get("large", 0) <= 0.25 * MAX_TOKENS


# ---- the demo's own R2R default, with the real demo pair ----------------------------------

DEMO_OVERRIDES = [
    "models=demo_pair",
    "policy=r2r_demo",
    "transport=zmq_ipc",
    "quality_monitor.sample_rate=0",
    # float64 on both sides: the reference's full-context forwards and the server's paged
    # ones then agree far below any router score or logit gap the answers depend on
    "models.small.dtype=float64",
    "models.large.dtype=float64",
    "models.small.num_cpus=0.5",
    "models.large.num_cpus=0.5",
]
DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 plus 7?",
]
DEMO_TOKENS = 20


def demo_cases() -> list[tuple[int, dict, bool]]:
    """(question, the request's `routing`, streamed): every preset, the balanced preset's
    value as a request's own threshold, a cap."""
    from tokenrouter_ray.app_config import compose_config

    presets = dict(compose_config(DEMO_OVERRIDES).policy.presets)
    assert set(presets) == {"high", "balanced", "fast"}
    return [
        (0, {"quality": "high"}, False),
        (1, {"quality": "balanced"}, True),
        (2, {"quality": "fast"}, False),
        (0, {"quality": "fast"}, True),
        (1, {"threshold": presets["balanced"]}, False),
        (2, {"quality": "fast", "max_large_share": 0.2}, False),
    ]


@pytest.mark.slow
@pytest.mark.demo
def test_served_demo_r2r_equals_the_reference(serve_apps) -> None:
    """The demo pair with its trained R2R router, as ``conf/local.yaml`` composes it: every
    preset, a request's own threshold and a cap, streamed and not, equal the sequential
    reference run with the same router (computed while the app deploys)."""
    cases = demo_cases()
    with serve_apps({"exact-demo": DEMO_OVERRIDES}, wait=False) as bases:
        references = demo_references(cases)
        wait_running(list(bases))
        got = demo_answers(bases["exact-demo"], cases)
    for (index, routing, stream), (text, ref), (served, meta) in zip(
        cases, references, got, strict=True
    ):
        where = f"question {index}, routing {routing}, streamed {stream}"
        assert served == text, where
        if meta is not None:
            assert meta["tokens_per_model"] == ref.counts, where
            assert meta["handoffs"] == ref.handoffs, where


def demo_references(cases: list[tuple[int, dict, bool]]) -> list:
    """(text, ``reference_generate``'s result) per case, and the routing is real."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenrouter_ray.app_config import compose_config
    from tokenrouter_ray.engine.request import SamplingParams
    from tokenrouter_ray.reference import reference_generate
    from tokenrouter_ray.routing.policy import build_policy

    cfg = compose_config(DEMO_OVERRIDES)
    names = list(cfg.model_names)
    tokenizer = AutoTokenizer.from_pretrained(cfg.models[names[-1]].path)
    presets = dict(cfg.policy.presets)
    models = [
        (n, AutoModelForCausalLM.from_pretrained(cfg.models[n].path, dtype=torch.float64).eval())
        for n in names
    ]
    policy = build_policy(cfg.policy.name, cfg.policy.options, names, tokenizer)
    references = []
    for index, routing, _ in cases:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": DEMO_QUESTIONS[index]}],
            add_generation_prompt=True, tokenize=True,
        )  # fmt: skip
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        threshold = presets.get(routing.get("quality"), routing.get("threshold"))
        sampling = SamplingParams(temperature=0.0, max_tokens=DEMO_TOKENS)
        ref = reference_generate(
            models, policy, prompt, sampling, seed=0, max_share=routing.get("max_large_share"),
            thresholds=(float(threshold),),
        )  # fmt: skip
        references.append((tokenizer.decode(ref.token_ids, skip_special_tokens=True), ref))
    assert sum(ref.handoffs for _, ref in references) > 5  # real routing on real models
    assert any(ref.counts.get("small") for _, ref in references)
    return references


def demo_answers(base: str, cases: list[tuple[int, dict, bool]]) -> list[tuple[str, dict | None]]:
    """(text, the response's ``routing``; None when streamed) per case, all at once."""
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)

    def call(case) -> tuple[str, dict | None]:
        index, routing, stream = case
        args = dict(
            model="tokenrouter", max_tokens=DEMO_TOKENS, temperature=0,
            messages=[{"role": "user", "content": DEMO_QUESTIONS[index]}],
            extra_body={"routing": routing},
        )  # fmt: skip
        if not stream:
            response = client.chat.completions.create(**args)
            return response.choices[0].message.content, response.model_extra["routing"]
        chunks = client.chat.completions.create(stream=True, **args)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(call, cases))


# ---- the chain over every transport (after the demo: these four apps stay up until the
# module ends) ----

TRANSPORTS = ["zmq_ipc", "zmq_tcp", "unix", "ray"]


@pytest.fixture(scope="module")
def chain_apps(serve_apps, served_chain_dirs) -> Iterator[dict[str, str]]:
    """The chain over every transport, deployed side by side: transport -> base URL."""
    named = {
        f"exact-{t.replace('_', '-')}": tiny_overrides(served_chain_dirs, CHAIN, "escalation", t)
        for t in TRANSPORTS
    }
    with serve_apps(named) as bases:
        yield dict(zip(TRANSPORTS, bases.values(), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_served_escalation_equals_the_reference(transport, chain_apps, references) -> None:
    client = openai.OpenAI(base_url=chain_apps[transport], api_key="none", max_retries=0)

    def call(request) -> tuple[list[int], dict | None]:
        index, routing, stream = request
        body = {"routing": routing} if routing else None
        args = dict(model="tokenrouter", prompt=prompts()[index], max_tokens=MAX_TOKENS,
                    temperature=0, extra_body=body)  # fmt: skip
        if not stream:
            response = client.completions.create(**args)
            return ids_of(response.choices[0].text), response.model_extra["routing"]
        text = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(stream=True, **args)
            if chunk.choices
        )
        return ids_of(text), None

    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        got = list(pool.map(call, REQUESTS))
    for (index, routing, stream), want, (tokens, meta) in zip(
        REQUESTS, references, got, strict=True
    ):
        where = f"prompt {index}, routing {routing}, streamed {stream}"
        assert tokens == want.token_ids, where
        if meta is not None:
            assert meta["tokens_per_model"] == want.counts, where
            assert meta["handoffs"] == want.handoffs, where
