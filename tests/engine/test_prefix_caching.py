"""Automatic prefix caching: the block pool's cache (no model), then the engine with tiny
real models, whose greedy tokens must equal transformers' generate with caching on, through
shared prefixes, batching, truncation into shared blocks and preemption."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import greedy_reference, make_engine
from tokenrouter_ray.engine.block_hash import prefix_block_hashes
from tokenrouter_ray.engine.block_pool import BlockPool, KVCacheManager
from tokenrouter_ray.engine.request import Request, SamplingParams

BS = 4


def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(cache_salt=salt), arrival_time=0.0)


def compute(kv: KVCacheManager, r: Request) -> None:
    """Prefill ``r`` as the scheduler and runner would: hit, allocate, compute the rest."""
    prefix = kv.cached_prefix(r)
    cached = prefix.num_tokens if prefix else 0
    assert kv.allocate_slots(r, r.num_tokens - cached, prefix) is not None
    r.advance_computed(r.num_tokens - r.num_computed_tokens)
    kv.cache_computed(r)  # what its next schedule (or pause) does


# ------------------------------------------------------------------ the hash chain
def test_block_hashes_chain_over_the_prefix_and_the_salt() -> None:
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS, 10)
    assert len(a) == 2  # full blocks only
    b = prefix_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS, 10)
    assert a[1] != b[1]  # same block, different parent: different hash
    assert prefix_block_hashes([1, 2, 3, 4], BS, 1, "tenant-a") != a[:1]
    assert prefix_block_hashes([1, 2, 3, 4], BS, 1, "t") != prefix_block_hashes(
        [1, 2, 3, 4], BS, 1, "u"
    )
    assert prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, 1) == a[:1]


# ----------------------------------------------------------------- the pool/manager
def test_second_request_reuses_full_blocks_but_never_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    system = list(range(100, 112))  # three full blocks
    a = request("a", [*system, 1, 2])
    compute(kv, a)
    b = request("b", [*system, 3, 4, 5])
    prefix = kv.cached_prefix(b)
    assert prefix.blocks == a.block_ids[:3] and prefix.num_tokens == 12
    compute(kv, b)
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert all(kv.pool.ref_counts[x] == 2 for x in a.block_ids[:3])
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (14 + 15, 12)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 12)  # the API's cached_tokens
    # A prompt made only of cached blocks still computes its last block's tokens.
    c = request("c", system)
    assert kv.cached_prefix(c).num_tokens == 8


def test_salt_keeps_tenants_apart_and_disabled_cache_finds_nothing() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    compute(kv, request("a", list(range(9)), salt="tenant-a"))
    assert kv.cached_prefix(request("b", list(range(9)), salt="tenant-b")).blocks == []
    assert kv.cached_prefix(request("c", list(range(9)))).blocks == []
    assert len(kv.cached_prefix(request("d", list(range(9)), salt="tenant-a")).blocks) == 2
    off = KVCacheManager(num_blocks=16, block_size=BS)
    compute(off, request("a", list(range(9))))
    assert off.cached_prefix(request("b", list(range(9)))) is None
    assert off.pool.num_cached_blocks == 0


def test_freed_blocks_stay_cached_count_as_free_and_are_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True)
    old, new = request("old", [*list(range(8)), 0]), request("new", [*list(range(50, 58)), 0])
    compute(kv, old)
    compute(kv, new)
    kv.free(old)
    kv.free(new)
    pool = kv.pool
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0  # cached blocks are free
    assert pool.num_cached_blocks == 4
    # Two plain blocks go first, then the least recently freed cached ones ("old"'s).
    assert pool.allocate(2) is not None and pool.num_cached_blocks == 4
    assert pool.allocate(2) is not None and pool.evictions == 2
    assert kv.cached_prefix(request("x", [*list(range(8)), 1])).blocks == []
    assert len(kv.cached_prefix(request("y", [*list(range(50, 58)), 1])).blocks) == 2


def test_failed_allocation_with_a_hit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = request("a", list(range(9)))
    compute(kv, a)
    kv.free(a)
    b = request("b", list(range(8)) + list(range(40)))  # needs 12 blocks, has 2 cached
    prefix = kv.cached_prefix(b)
    assert len(prefix.blocks) == 2
    assert kv.allocate_slots(b, b.num_tokens - 8, prefix) is None
    assert b.block_ids == [] and b.num_computed_tokens == 0 and kv.prefix_cache_queries == 9
    assert b.num_cached_tokens == -1  # not computed yet
    assert kv.pool.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2


def test_truncate_into_a_shared_block_gives_it_up_and_a_private_one_leaves_the_cache() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a = request("a", list(range(10)))
    compute(kv, a)
    b = request("b", list(range(10)))
    compute(kv, b)
    shared = b.block_ids[1]
    assert kv.pool.ref_counts[shared] == 2
    # b's tokens past 6 were replaced (a dropped token): the shared block 1 must not be
    # written, so b gives it up and recomputes positions 4..5 in a block of its own.
    del b.token_ids[6:]
    kv.truncate(b, 6)
    assert b.block_ids == a.block_ids[:1] and b.num_computed_tokens == 4
    assert kv.pool.ref_counts[shared] == 1 and kv.pool.lookup(a.block_hashes[1]) == shared
    # a alone holds its block 1: truncating into it takes it out of the cache instead.
    kv.free(b)
    del a.token_ids[6:]
    kv.truncate(a, 6)
    assert a.block_ids[1] == shared and a.num_computed_tokens == 6
    assert kv.pool.block_hash[shared] is None and kv.pool.num_cached_blocks == 1
    a.token_ids += [7, 7, 7]
    compute(kv, a)  # re-registers block 1 under its new content
    assert kv.pool.lookup(a.block_hashes[1]) == shared


def test_preempted_request_finds_its_own_blocks_again() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    r = request("r", list(range(13)))
    compute(kv, r)
    blocks = list(r.block_ids)
    kv.free(r)  # preemption by recompute
    prefix = kv.cached_prefix(r)
    assert prefix.blocks == blocks[:3]
    compute(kv, r)
    assert r.block_ids[:3] == blocks[:3]
    assert r.num_cached_tokens == 0  # what its first computation found, not the recompute


def test_incref_and_touch_refuse_blocks_that_are_not_theirs() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.touch([0])  # not cached
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError):
        pool.cache(b, b"x" * 16)  # only held blocks are cached


# ------------------------------------------------------------------ with real models
def shared_prompts(n: int, system: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(128) for _ in range(system)]
    return [head + [rng.randrange(128) for _ in range(rng.randint(1, 9))] for _ in range(n)]


def drain(engine, produced: dict[str, list[int]]) -> None:
    while engine.has_runnable:
        result = engine.execute(now=float("inf"))
        if result is not None:
            for out in engine.commit(result):
                produced.setdefault(out.request_id, []).extend(out.new_token_ids)


@pytest.mark.parametrize("num_blocks", [256, 12])  # 12: KV full, preemption by recompute
def test_shared_prefix_batches_equal_generate_with_caching(
    tiny_llama_dir, reference_model, num_blocks
) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=num_blocks, max_num_batched_tokens=24)
    prompts = shared_prompts(6, system=14, seed=7)
    produced: dict[str, list[int]] = {}
    engine.add_request("r0", prompts[0], SamplingParams(max_tokens=10))
    drain(engine, produced)  # the first one warms the cache; the rest arrive together
    for i, p in enumerate(prompts[1:], start=1):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10))
    drain(engine, produced)
    ref = reference_model(tiny_llama_dir)
    for i, p in enumerate(prompts):
        assert produced[f"r{i}"] == greedy_reference(ref, p, 10), f"request r{i}"
    kv = engine.kv
    assert kv.prefix_cache_hits >= 5 * 12  # every later request reused the system blocks
    if num_blocks == 12:
        assert engine.scheduler.num_preemptions > 0
    assert kv.pool.num_free_blocks == kv.pool.num_blocks  # nothing leaked


def test_dropped_token_in_a_shared_block_recomputes_exactly(
    tiny_llama_dir, reference_model
) -> None:
    """Two requests share cached blocks; one is paused and resumed at an anchor inside a
    shared block (another model replaced its tokens): its output follows the new context
    and the other's is untouched."""
    engine = make_engine(tiny_llama_dir)
    ref = reference_model(tiny_llama_dir)
    (prompt,) = shared_prompts(1, system=10, seed=8)
    produced: dict[str, list[int]] = {}
    engine.add_request("a", prompt, SamplingParams(max_tokens=12))
    drain(engine, produced)  # a finished: its blocks are cached
    engine.add_request("b", prompt, SamplingParams(max_tokens=24))
    engine.add_request("c", prompt, SamplingParams(max_tokens=12))
    for _ in range(3):
        for out in engine.step():
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    b = engine.requests["b"]
    assert engine.kv.pool.ref_counts[b.block_ids[1]] == 2  # shared with c
    engine.pause("b")
    anchor, extra = 6, [5, 6, 7]  # inside block 1 (positions 4..7)
    engine.resume("b", extra, anchor=anchor)
    context = prompt[:anchor] + extra
    produced["b"] = []
    drain(engine, produced)
    assert produced["b"] == greedy_reference(ref, context, 24 - (len(context) - len(prompt)))
    assert produced["a"] == produced["c"] == greedy_reference(ref, prompt, 12)


def test_caching_off_recomputes_everything(tiny_llama_dir) -> None:
    engine = make_engine(tiny_llama_dir, prefix_caching=False)
    prompts = shared_prompts(3, system=12, seed=9)
    on = make_engine(tiny_llama_dir)
    assert engine.generate(prompts, SamplingParams(max_tokens=6)) == on.generate(
        prompts, SamplingParams(max_tokens=6)
    )
    assert engine.kv.prefix_cache_hits == 0 and engine.kv.pool.num_cached_blocks == 0


# ------------------------------------------------------------------ config and salt
def test_cache_salt_travels_from_the_openai_body_to_the_engine(tiny_llama_dir) -> None:
    from tokenrouter_ray.openai.errors import InvalidRequestError
    from tokenrouter_ray.openai.schemas import CompletionRequest
    from tokenrouter_ray.openai.validation import RequestLimits, parse_request, prepare_completion
    from tokenrouter_ray.protocol import MsgKind, PeerReq, decode, encode

    body = {"model": "m", "prompt": list(range(1, 14)), "max_tokens": 4, "temperature": 0}
    limits = RequestLimits(max_model_len=64)
    specs = {}
    for salt in ("tenant-a", "tenant-b", None):
        request = parse_request(CompletionRequest, {**body, "cache_salt": salt})
        spec = prepare_completion(request, None, limits).sampling.to_spec()
        frame = PeerReq("r", "ingress", "small", MsgKind.NEW, 1, [1], sampling=spec)
        specs[salt] = decode(encode(frame)).sampling  # as a model replica receives it
        assert specs[salt].cache_salt == salt
    with pytest.raises(InvalidRequestError):
        parse_request(CompletionRequest, {**body, "cache_salt": ""})
    engine = make_engine(tiny_llama_dir)
    prompt = body["prompt"]
    engine.add_request("a", prompt, specs["tenant-a"])
    engine.step()
    engine.step()
    for rid, salt in (("b", "tenant-b"), ("c", None), ("d", "tenant-a")):
        engine.add_request(rid, prompt, specs[salt])
    engine.step()
    assert engine.kv.prefix_cache_hits == 12  # only tenant-a's second request hit
    assert engine.requests["b"].block_ids[0] != engine.requests["d"].block_ids[0]


def test_model_spec_turns_caching_off() -> None:
    from deployments.model_server import engine_config
    from tokenrouter_ray.config import AppConfig

    models = {"small": {"path": "/x"}, "large": {"path": "/y", "prefix_caching": False}}
    cfg = AppConfig(models=models, policy={"name": "never"})
    assert engine_config(cfg, "small").prefix_caching is True  # on by default
    assert engine_config(cfg, "large").prefix_caching is False


@pytest.mark.parametrize("chunk", [64, 6])  # 6: the prefill itself is chunked over steps
def test_a_prefill_only_request_leaves_its_blocks_cached_and_samples_nothing(
    tiny_llama_dir, reference_model, chunk
) -> None:
    """``Engine.prefill`` (a prompt prefilled where a handoff will take it): it
    samples no token, ends once computed, and the request that then arrives with the prompt
    first (plus tokens it has not seen) computes only what is past the cached blocks; its
    greedy output equals generate's."""
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=chunk)
    (prompt,) = shared_prompts(1, system=17, seed=9)
    assert engine.prefill("p", prompt) is not None
    rows = 0
    while engine.has_unfinished:
        result = engine.execute(now=float("inf"))
        if result is not None:
            rows += len(result.request_ids)
            assert engine.commit(result) == []
    assert rows == 0 and "p" not in engine.requests
    kv = engine.kv
    full = (len(prompt) - 1) // BS * BS
    assert kv.pool.num_free_blocks == kv.pool.num_blocks  # freed, and kept cached
    assert engine.prefill("again", prompt) is None  # all of it is cached: nothing to do
    context = [*prompt, 3, 5, 7]  # a handoff's first visit: the prompt and what followed
    produced: dict[str, list[int]] = {}
    engine.add_request("h", context, SamplingParams(max_tokens=8))
    drain(engine, produced)
    assert kv.prefix_cache_hits == full
    assert produced["h"] == greedy_reference(reference_model(tiny_llama_dir), context, 8)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_prefill_does_nothing_without_prefix_caching(tiny_llama_dir) -> None:
    engine = make_engine(tiny_llama_dir, prefix_caching=False)
    assert engine.prefill("p", list(range(1, 30))) is None and not engine.has_unfinished
