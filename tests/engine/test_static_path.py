"""The bucketed fixed-shape path (what CUDA graphs capture), run eagerly on CPU: same tokens
and logits as the dynamic path, for decodes, multi-token extends and padded buckets."""

from __future__ import annotations

import torch

from tests.engine.conftest import greedy_reference, make_engine
from tests.engine.test_engine import drain, prompts_of
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.static_forward import bucket, build_host_batch


def test_buckets_round_up_and_stop_at_the_largest() -> None:
    assert [bucket(v, (1, 2, 4, 8)) for v in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_host_batch_pads_in_front_and_points_padding_at_the_scratch_block() -> None:
    # Two sequences in a (batch 4, q_len 4) bucket, block size 4, scratch block 9.
    seqs = [(5, [11, 12, 13], [3, 7]), (2, [21], [4])]
    host = build_host_batch(seqs, 4, 4, max_blocks=3, block_size=4, scratch_block=9,
                            with_mask=True)  # fmt: skip
    assert host.input_ids.tolist()[:8] == [0, 11, 12, 13, 0, 0, 0, 21]
    assert host.positions.tolist()[:8] == [0, 5, 6, 7, 0, 0, 0, 2]
    # positions 5, 6, 7 live in block 7 (second block) at offsets 1, 2, 3
    assert host.slots.tolist()[:8] == [36, 29, 30, 31, 36, 36, 36, 18]
    assert host.slots.tolist()[8:] == [36] * 8  # padded sequences write to the scratch block
    assert host.block_table.tolist() == [[3, 7, 9], [4, 9, 9], [9, 9, 9], [9, 9, 9]]
    assert host.ctx_lens.tolist() == [8, 3, 1, 1]
    last_rows = host.mask[:2, 0, -1]  # the sampled row sees exactly its context
    assert last_rows.sum(-1).tolist() == [8, 3]
    assert host.mask[:, 0].any(-1).all()  # no row is fully masked (no NaN from SDPA)


def test_static_path_equals_generate_with_decodes_and_extends(
    tiny_model_dir, reference_model
) -> None:
    """8 requests (odd batch sizes pad to buckets), one paused and resumed with a 3-token
    extend mid-flight: every token equals generate(), and most steps were static."""
    engine = make_engine(tiny_model_dir, static_batches=True, keep_logits=True)
    ref = reference_model(tiny_model_dir)
    prompts = prompts_of([3, 9, 5, 12, 7, 4, 10, 6], seed=5)
    for i, p in enumerate(prompts[:7]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10))
    produced: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.commit(engine.execute()):
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.pause("r0")
    for out in engine.commit(engine.execute()):
        produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    held = list(engine.requests["r0"].token_ids)
    extra = prompts[7][:3]
    engine.resume("r0", extra, anchor=len(held) - 1)  # replace the last token, add 3
    context = held[:-1] + extra
    before = len(produced["r0"])
    result = engine.execute()  # r0's 3-token extend beside 6 decodes: bucket (8, 4)
    row = result.request_ids.index("r0")
    with torch.no_grad():
        expected = ref(torch.tensor([context])).logits[0, -1]
    torch.testing.assert_close(result.logits[row], expected.float(), atol=1e-5, rtol=0)
    for out in engine.commit(result):
        produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    drain(engine, produced)
    for i, p in enumerate(prompts[1:7], start=1):
        assert produced[f"r{i}"] == greedy_reference(ref, p, 10), f"request r{i}"
    # The rerouted request continues greedily from its new context.
    remaining = 10 - (len(context) - len(prompts[0]))
    assert produced["r0"][before:] == greedy_reference(ref, context, remaining)
    runner = engine.runner
    assert runner.static_steps >= 8 and any(k[:2] == (8, 4) for k in runner.static)
    assert len({width for _, _, width in runner.static}) >= 2  # KV width buckets grew
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_long_chunks_take_the_dynamic_path(tiny_llama_dir, reference_model) -> None:
    engine = make_engine(tiny_llama_dir, static_batches=True, max_num_batched_tokens=64)
    (prompt,) = prompts_of([20], seed=6)  # a 20-token prefill exceeds every query bucket
    engine.add_request("a", prompt, SamplingParams(max_tokens=6))
    engine.step()
    assert engine.runner.static_steps == 0
    produced = {"a": list(engine.requests["a"].output_token_ids)}
    drain(engine, produced)
    assert engine.runner.static_steps == 5  # every decode after it
    assert produced["a"] == greedy_reference(reference_model(tiny_llama_dir), prompt, 6)


def test_static_forward_never_reads_device_data_on_the_host(tiny_model_dir) -> None:
    """Every bucket's forward runs with the model, the KV cache and all metadata on the
    ``meta`` device, which has shapes but no data: any ``.item()``, ``int(tensor)``,
    ``.tolist()``, data-dependent shape (``nonzero``) or tensor built from Python data in
    the forward would raise. Such an op would also break CUDA-graph capture."""
    from tokenrouter_ray.engine.kv_cache import PagedKVCache
    from tokenrouter_ray.engine.static_forward import StaticForward

    engine = make_engine(tiny_model_dir)
    model = engine.runner.model.to("meta")
    cfg = model.config
    kv = PagedKVCache(
        num_layers=cfg.num_hidden_layers,
        num_blocks=9,
        block_size=4,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=engine.runner.kv.head_dim,
        dtype=torch.float64,
        device="meta",
    )
    for batch, q_len, width in [(1, 1, 1), (4, 1, 2), (8, 4, 8)]:
        fwd = StaticForward(model.get_decoder(), model.get_output_embeddings(), kv, batch,
                            q_len, width, use_flash=False, scratch_block=8)  # fmt: skip
        with torch.inference_mode():
            fwd._forward()
        assert fwd.logits.device.type == "meta"
        assert fwd.logits.shape == (batch, cfg.vocab_size)


def test_the_forward_computes_the_mask_the_host_would_build(tiny_model_dir) -> None:
    """The runner sends no mask: each bucket's forward computes it from ``ctx_lens`` on the
    device, equal to the host-built one, and every bucket writes its logits into one
    shared buffer (not one fp32 logits tensor per captured graph)."""
    engine = make_engine(tiny_model_dir, static_batches=True)
    runner = engine.runner
    runner.capture_static()
    fwd = runner.static[max(runner.static, key=lambda s: (s[1], s[0]))]
    seqs = [(5, [11, 12, 13][: fwd.q_len], [3, 7]), (2, [21], [4])][: fwd.batch]
    host = build_host_batch(seqs, fwd.batch, fwd.q_len, fwd.max_blocks, runner.kv.block_size,
                            runner.scratch_block, with_mask=False)  # fmt: skip
    want = build_host_batch(seqs, fwd.batch, fwd.q_len, fwd.max_blocks, runner.kv.block_size,
                            runner.scratch_block, with_mask=True).mask  # fmt: skip
    assert host.mask is None
    with torch.inference_mode():
        fwd.run(host)
    assert torch.equal(fwd.meta.mask, want)
    buffers = {f.logits.data_ptr() for f in runner.static.values()}
    assert len(runner.static) > 1 and len(buffers) == 1
    assert all(f.logits.dtype == torch.float32 for f in runner.static.values())
