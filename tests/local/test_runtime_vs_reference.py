"""LocalRuntime (8 concurrent requests, paged KV, batching, PeerReqs over in-process
channels) produces exactly the sequential reference's tokens and per-model counts, for
every policy."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch

from tests.tiny_models import chain_engines
from tests.waiting import wait_until
from tokenrouter_ray.engine.block_hash import prefix_block_hashes
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import MsgKind, SamplingSpec, encode_batch
from tokenrouter_ray.reference import ReferenceResult, reference_generate
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.transport.inproc import InProcChannel

TWO = ["small", "large"]
CASES = {
    "never": ({}, TWO),
    "always": ({}, TWO),
    "bernoulli": ({"p": 0.35}, TWO),
    "entropy": ({"threshold": 0.45}, TWO),
    "r2r": ({"threshold": 0.45}, TWO),
    "citer": ({"threshold": 0.5}, TWO),
    "co_llm": ({"threshold": 0.5}, TWO),
    "rstitch": ({"tau": 0.45}, TWO),
    "glimprouter": ({"tau": 0.45, "step_end_token_ids": list(range(0, 128, 3))}, TWO),
    "escalation": ({"thresholds": [0.45, 0.4]}, ["small", "mid", "large"]),
}
MAX_TOKENS = 40
SEED = 1234


def prompts(n: int = 8) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(128) for _ in range(rng.randint(1, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(chain_reference_models) -> Callable[..., ReferenceResult]:
    """The sequential reference of ``CASES[name]``'s policy for one prompt, computed once per
    module: several tests compare against the same one, it is deterministic, and its
    full-context forward per token is most of this file's time."""
    done: dict[tuple, ReferenceResult] = {}

    def run(name: str, prompt: list[int], max_share=None, thresholds=()) -> ReferenceResult:
        key = (name, tuple(prompt), max_share, tuple(thresholds))
        if key not in done:
            options, names = CASES[name]
            done[key] = reference_generate(
                [(n, chain_reference_models[n]) for n in names],
                build_policy(name, options, names),
                prompt,
                SamplingParams(max_tokens=MAX_TOKENS),
                SEED,
                max_share=max_share,
                thresholds=tuple(thresholds),
            )
        return done[key]

    return run


def run_local(
    policy, engines, channel_type=InProcChannel, n: int = 8, prefill_at=None, on_start=None
):
    async def go():
        async with LocalRuntime(engines, policy, channel_type, prefill_at=prefill_at) as runtime:
            if on_start is not None:
                on_start(runtime)
            spec = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, seed=SEED)
            results = await asyncio.wait_for(runtime.complete_all(prompts(n), spec), 120)
            await runtime.wait_idle()
            pools = [s.engine.kv.pool for s in runtime.model_replicas]
            assert all(p.num_free_blocks == p.num_blocks for p in pools)  # no leaked KV
            return results, runtime.handoffs

    return asyncio.run(go())


@pytest.mark.parametrize("name", list(CASES))
def test_local_runtime_equals_reference(name, chain_dirs, reference) -> None:
    options, names = CASES[name]
    policy = build_policy(name, options, names)
    results, handoffs = run_local(policy, chain_engines(chain_dirs, names))
    for prompt, got in zip(prompts(), results, strict=True):
        want = reference(name, prompt)
        assert got.error is None
        assert got.token_ids == want.token_ids
        assert got.counts == want.counts
        assert got.handoffs == want.handoffs
        assert got.finish_reason == want.finish_reason
    most = max(r.handoffs for r in results)
    if name == "never":
        assert most == 0 and not handoffs
    else:
        assert most >= 12, f"{name}: routing too rare to exercise handoffs ({most})"
    if name in ("always", "bernoulli", "escalation"):
        assert most >= 24  # dozens of handoffs in one request


def test_handoffs_send_only_the_unseen_suffix(chain_dirs) -> None:
    """Replay every handoff in order: each sends exactly sequence[anchor:] where anchor is
    what the destination held after its last visit; never the full context again."""
    names = ["small", "mid", "large"]
    policy = build_policy("escalation", CASES["escalation"][0], names)
    _, handoffs = run_local(policy, chain_engines(chain_dirs, names))
    by_request: dict[str, list] = {}
    for h in handoffs:
        by_request.setdefault(h.rid, []).append(h)
    revisits = 0
    for records in by_request.values():
        held: dict[str, int] = {}
        for h in sorted(records, key=lambda h: h.seq):
            assert h.anchor == held.get(h.dst, 0)
            assert h.num_tokens == h.end - h.anchor
            assert h.first_visit == (h.dst not in held)
            if not h.first_visit:
                revisits += 1
                assert h.num_tokens < h.end  # a suffix, not the context
            held[h.src] = held[h.dst] = h.end
    assert revisits > 50


@pytest.mark.parametrize("name", ["never", "always", "bernoulli", "entropy"])
def test_prompts_prefilled_at_admission_change_no_token(name, chain_dirs, reference) -> None:
    """``prefill_at`` (``models.large.prefill_at_admission``): every prompt is
    also prefilled on the large model at admission. Outputs equal the reference, nothing
    leaks, and the large model's first visits found the prompts' blocks in its cache (with
    ``never`` it is the cost alone: prompts prefilled and never used)."""
    options, names = CASES[name]
    policy = build_policy(name, options, names)
    engines = chain_engines(chain_dirs, names)
    large = dict(engines)["large"].kv
    block = large.block_size
    # The last full block of every prompt, as the large model caches it once prefilled
    lasts = [prefix_block_hashes(p, block, (len(p) - 1) // block)[-1:] for p in prompts()]
    prefilled = lambda: all(large.pool.lookup(h) is not None for last in lasts for h in last)  # noqa: E731
    results, _ = run_local(
        policy,
        engines,
        NewAfterPrefills,
        prefill_at={"large": 1},
        on_start=lambda runtime: NewAfterPrefills.wait_for(prefilled),
    )
    for prompt, got in zip(prompts(), results, strict=True):
        want = reference(name, prompt)
        assert (got.error, got.token_ids, got.counts) == (None, want.token_ids, want.counts)
    cacheable = sum((len(p) - 1) // 4 * 4 for p in prompts())  # full blocks, block size 4
    if name == "never":
        assert large.prefix_cache_hits == 0
    else:
        assert large.prefix_cache_hits >= cacheable


class NewAfterPrefills(InProcChannel):
    """Holds the ingress's NEW frames until ``wait_for``'s condition holds (every prompt's
    admission PREFILL done on the large model): the first handoffs then find the prompts
    cached whatever the host's speed, instead of racing their own PREFILL."""

    ready: Callable[[], bool] = staticmethod(lambda: True)
    held: ClassVar[set[asyncio.Task]] = set()

    @classmethod
    def wait_for(cls, ready: Callable[[], bool]) -> None:
        cls.ready = staticmethod(ready)

    async def _send_frame(self, dst, msgs) -> int:
        if self.model != "ingress" or all(m.kind != MsgKind.NEW for m in msgs):
            return await super()._send_frame(dst, msgs)
        frame = encode_batch(msgs)

        async def deliver() -> None:
            await wait_until(type(self).ready, timeout_s=120)
            self.hub.deliver(dst.address, frame)

        task = asyncio.get_running_loop().create_task(deliver())
        self.held.add(task)
        task.add_done_callback(self.held.discard)
        return len(frame)


class DuplicatingChannel(InProcChannel):
    """Delivers every frame twice: duplicates must change nothing."""

    async def _send_frame(self, dst, msgs) -> None:
        await super()._send_frame(dst, msgs)
        await super()._send_frame(dst, msgs)


def test_duplicated_messages_change_nothing(chain_dirs, reference) -> None:
    policy = build_policy("bernoulli", *CASES["bernoulli"])
    results, _ = run_local(policy, chain_engines(chain_dirs, TWO), DuplicatingChannel)
    for prompt, got in zip(prompts(), results, strict=True):
        want = reference("bernoulli", prompt)
        assert (got.token_ids, got.counts) == (want.token_ids, want.counts)


def shared_prompts(n: int = 8) -> list[list[int]]:
    """Prompts under one 16-token system prompt (four KV blocks of the test engines)."""
    rng = random.Random(5)
    system = [rng.randrange(128) for _ in range(16)]
    return [system + [rng.randrange(128) for _ in range(rng.randint(1, 14))] for _ in range(n)]


def run_waves(policy, engines, waves: list[list[list[int]]]):
    """One runtime, prompts in waves (each after the previous one finished), so later
    waves find the earlier ones' blocks cached on every model they visit."""

    async def go():
        async with LocalRuntime(engines, policy, InProcChannel) as runtime:
            spec = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, seed=SEED)
            results = []
            for wave in waves:
                results += await asyncio.wait_for(runtime.complete_all(wave, spec), 120)
                await runtime.wait_idle()
            pools = [s.engine.kv.pool for s in runtime.model_replicas]
            assert all(p.num_free_blocks == p.num_blocks for p in pools)  # no leaked KV
            return results, [s.engine.kv.prefix_cache_hits for s in runtime.model_replicas]

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("name", "caching"),
    [(name, True) for name in CASES] + [("r2r", False), ("escalation", False)],
)
def test_prefix_caching_equals_reference(name, caching, chain_dirs, reference) -> None:
    """Shared-prefix prompts in two waves, with prefix caching on (and off): the tokens and
    per-model counts equal the sequential reference; with caching on, the later wave's
    requests reuse the system prompt's blocks on the entry model, and handoffs' first
    visits reuse them on the models they reach."""
    options, names = CASES[name]
    policy = build_policy(name, options, names)
    engines = chain_engines(chain_dirs, names, prefix_caching=caching)
    prompts = shared_prompts()
    results, hits = run_waves(policy, engines, [prompts[:2], prompts[2:]])
    for prompt, got in zip(prompts, results, strict=True):
        want = reference(name, prompt)
        assert got.error is None
        assert (got.token_ids, got.counts, got.handoffs) == (
            want.token_ids,
            want.counts,
            want.handoffs,
        )
    cached = [got.summary.cached_tokens for got in results]  # usage's cached_tokens
    if not caching:
        assert hits == [0] * len(names)
        assert cached == [0] * len(prompts)
        return
    assert hits[0] >= 6 * 16  # every request of the second wave hit the system prompt
    assert all(16 <= c < len(p) for c, p in zip(cached[2:], prompts[2:], strict=True))
    assert sum(cached) == hits[0]  # what the entry model found, request by request
    if name != "never":
        assert hits[-1] > 0  # first visits of handoffs hit on the last model too


# Per-request routing thresholds (the API's ``routing`` field): rows with different
# thresholds share every batch. None: the policy's configured value.
THRESHOLD_POLICIES = [n for n in CASES if n not in ("never", "always")]
OVERRIDES: list[tuple[float, ...]] = [(), (0.0,), (1.0,), (), (0.3,), (0.6,), (0.05,), (0.95,)]
PER_LEVEL = {6: (0.0, 1.0), 7: (1.0, 0.0)}  # escalation: one value per level


def request_thresholds(name: str) -> list[tuple[float, ...]]:
    if name != "escalation":
        return OVERRIDES
    return [PER_LEVEL.get(i, t) for i, t in enumerate(OVERRIDES)]


def outcome(result) -> tuple:
    """What a served request and its reference run must agree on."""
    return (result.token_ids, result.counts, result.handoffs, result.finish_reason)


def run_local_each(policy, engines, specs: list[SamplingSpec], caps=None, thresholds=None):
    """One runtime, one request per spec (with its cap on the top model's share and its own
    thresholds), at once."""
    caps = caps or [None] * len(specs)
    thresholds = thresholds or [()] * len(specs)

    async def go():
        async with LocalRuntime(engines, policy, InProcChannel) as runtime:
            work = (
                runtime.complete(p, s, max_share=cap, thresholds=t)
                for p, s, cap, t in zip(prompts(len(specs)), specs, caps, thresholds, strict=True)
            )
            results = await asyncio.wait_for(asyncio.gather(*work), 120)
            await runtime.wait_idle()
            pools = [s.engine.kv.pool for s in runtime.model_replicas]
            assert all(p.num_free_blocks == p.num_blocks for p in pools)  # no leaked KV
            return list(results)

    return asyncio.run(go())


@pytest.mark.parametrize("name", THRESHOLD_POLICIES)
def test_per_request_thresholds_equal_reference(name, chain_dirs, reference) -> None:
    """8 concurrent greedy requests, each with its own threshold (none, 0, 1, low, high, and
    per level for escalation), in one runtime: each equals the reference run with the same
    threshold; and the thresholds did change routing (compared with the configured one)."""
    options, names = CASES[name]
    policy = build_policy(name, options, names)
    thresholds = request_thresholds(name)
    specs = [SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, seed=SEED) for _ in thresholds]
    engines = chain_engines(chain_dirs, names)
    results = run_local_each(policy, engines, specs, thresholds=thresholds)
    changed = 0
    for prompt, got, t in zip(prompts(), results, thresholds, strict=True):
        want = reference(name, prompt, thresholds=t)
        assert got.error is None
        assert outcome(got) == outcome(want), f"{name}: request with thresholds {t}"
        if t:
            plain = reference(name, prompt)
            changed += (plain.counts, plain.handoffs) != (want.counts, want.handoffs)
    assert changed >= 4, f"{name}: the per-request thresholds changed too little ({changed})"


@pytest.mark.parametrize("name", THRESHOLD_POLICIES)
def test_extreme_thresholds_route_as_expected(name, reference) -> None:
    """The reference honours an override in the policy's direction: at one extreme the
    entry model writes every token, at the other the larger models write some (so an
    ignored override could not pass the test above by chance)."""
    names = CASES[name][1]
    prompt = prompts()[0]
    # the threshold at which the policy never hands off: above every score, or p = 0
    never = 0.0 if name in ("bernoulli", "citer") else 1.0
    runs = {t: reference(name, prompt, thresholds=(t,)) for t in (never, 1.0 - never)}
    assert runs[never].counts == {names[0]: len(runs[never].token_ids)}
    assert runs[never].handoffs == 0
    assert runs[1.0 - never].handoffs > 0


def greedy_alone(model, prompt: list[int], max_tokens: int) -> list[int]:
    """One model's greedy answer, written from the definition (argmax of the last logits
    until EOS or ``max_tokens``): no sampler, engine or policy of the runtime's."""
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    sequence, out = list(prompt), []
    with torch.inference_mode():
        while len(out) < max_tokens:
            token = int(model(torch.tensor([sequence])).logits[0, -1].argmax())
            out.append(token)
            sequence.append(token)
            if token in eos:
                break
    return out


@pytest.mark.parametrize("alone", ["large", "small"])
def test_a_request_served_alone_is_that_models_own_answer(
    alone, chain_dirs, chain_reference_models, reference
) -> None:
    """Single-model bypass (``routing.model``): under a policy that hands off dozens of
    times a request, a request served alone is the model's own greedy answer, every token
    written by it, with no handoff; requests routed beside it are routed as before."""
    policy = build_policy("bernoulli", *CASES["bernoulli"])
    spec = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, seed=SEED)

    async def go():
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as runtime:
            alone_results = [runtime.complete(p, spec, alone=alone) for p in prompts()]
            routed = [runtime.complete(p, spec) for p in prompts()]
            done = await asyncio.wait_for(asyncio.gather(*alone_results, *routed), 120)
            await runtime.wait_idle()
            pools = [s.engine.kv.pool for s in runtime.model_replicas]
            assert all(p.num_free_blocks == p.num_blocks for p in pools)  # no leaked KV
            return done, runtime.handoffs

    done, handoffs = asyncio.run(go())
    served, routed = done[: len(prompts())], done[len(prompts()) :]
    model = chain_reference_models[alone]
    for prompt, got in zip(prompts(), served, strict=True):
        assert got.error is None
        assert got.token_ids == greedy_alone(model, prompt, MAX_TOKENS)
        assert (got.counts, got.handoffs) == ({alone: len(got.token_ids)}, 0)
    served_ids = {c.request_id for c in served}
    assert not [h for h in handoffs if h.rid in served_ids]
    for prompt, got in zip(prompts(), routed, strict=True):
        want = reference("bernoulli", prompt)
        assert (got.token_ids, got.counts) == (want.token_ids, want.counts)


@pytest.mark.parametrize("name", ["always", "bernoulli", "r2r", "escalation"])
def test_per_request_caps_on_the_large_share_equal_reference(name, chain_dirs, reference) -> None:
    """``routing.max_large_share``: 8 concurrent greedy requests, each with its own cap on
    the top model's share (none, 0, 0.1 .. 0.9, 1; with a per-request threshold on two),
    equal the reference run with the same cap; no answer's top share passes its cap, and
    the caps did bind (some answer differs from its uncapped run)."""
    options, names = CASES[name]
    policy = build_policy(name, options, names)
    caps = [None, 0.0, 0.1, 0.25, 0.4, 0.6, 0.9, 1.0]
    thresholds = [()] * 6 + ([(0.9,), (0.1,)] if name in THRESHOLD_POLICIES else [()] * 2)
    specs = [SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, seed=SEED) for _ in thresholds]
    results = run_local_each(policy, chain_engines(chain_dirs, names), specs, caps, thresholds)
    bound = 0
    for prompt, got, cap, t in zip(prompts(), results, caps, thresholds, strict=True):
        want = reference(name, prompt, max_share=cap, thresholds=t)
        assert got.error is None
        assert outcome(got) == outcome(want)
        top = got.counts.get(names[-1], 0)
        if cap is not None:
            assert top <= cap * len(got.token_ids) + 1e-9
            free = reference(name, prompt, thresholds=t)
            bound += free.counts != want.counts
    assert bound >= 2
