"""Penalties, logit_bias, min_tokens and min_p across handoffs: LocalRuntime (batching,
paged KV, PeerReqs) equals the sequential reference with the same sampling, for policies
that hand off (and drop proposals), so each model applies them to the request's whole
committed sequence, whichever model wrote it."""

from __future__ import annotations

import asyncio

import pytest

from tests.local.test_runtime_vs_reference import CASES, SEED, prompts
from tests.tiny_models import chain_engines
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.reference import reference_generate
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.transport.inproc import InProcChannel

MAX_TOKENS = 32
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.3)
SAMPLINGS = {
    "penalties": SamplingSpec(max_tokens=MAX_TOKENS, seed=SEED, **PENALTIES),
    "bias+min_tokens": SamplingSpec(
        max_tokens=MAX_TOKENS,
        seed=SEED,
        logit_bias=((5, 3.0), (64, -100.0)),
        stop_token_ids=(3, 17, 42),
        min_tokens=12,
        repetition_penalty=1.2,
    ),
    "sampled": SamplingSpec(
        temperature=0.8, top_k=40, min_p=0.05, max_tokens=MAX_TOKENS, seed=SEED, **PENALTIES
    ),
}


def run_local(policy, engines, spec: SamplingSpec):
    async def go():
        async with LocalRuntime(engines, policy, InProcChannel) as runtime:
            results = await asyncio.wait_for(runtime.complete_all(prompts(), spec), 120)
            await runtime.wait_idle()
            pools = [s.engine.kv.pool for s in runtime.model_replicas]
            assert all(p.num_free_blocks == p.num_blocks for p in pools)  # no leaked KV
            return results

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("name", "sampling"),
    [
        ("bernoulli", "penalties"),
        ("r2r", "bias+min_tokens"),  # r2r drops the small model's proposal at a handoff
        ("r2r", "sampled"),
        ("escalation", "sampled"),  # three models
    ],
)
def test_processors_across_handoffs_equal_reference(
    name: str, sampling: str, chain_dirs, chain_reference_models
) -> None:
    options, names = CASES[name]
    policy = build_policy(name, options, names)
    spec = SAMPLINGS[sampling]
    results = run_local(policy, chain_engines(chain_dirs, names), spec)
    models = [(n, chain_reference_models[n]) for n in names]
    changed = 0
    for prompt, got in zip(prompts(), results, strict=True):
        want = reference_generate(models, policy, prompt, spec, SEED)
        assert got.error is None
        assert got.token_ids == want.token_ids
        assert (got.counts, got.handoffs, got.finish_reason) == (
            want.counts,
            want.handoffs,
            want.finish_reason,
        )
        plain = reference_generate(
            models, policy, prompt, SamplingSpec(max_tokens=MAX_TOKENS, seed=SEED), SEED
        )
        changed += plain.token_ids != want.token_ids
        if spec.min_tokens:
            early = [t for t in got.token_ids[: spec.min_tokens] if t in spec.stop_token_ids]
            assert not early and 64 not in got.token_ids
    assert max(r.handoffs for r in results) >= 8  # handoffs happened
    assert changed >= len(results) // 2  # the processors changed most outputs
    if spec.min_tokens:
        assert any(r.finish_reason == "stop" for r in results)  # stop tokens work after it
