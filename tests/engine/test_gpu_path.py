"""What the CUDA path depends on, checked on CPU: warm-up and capture touch only
the scratch block, flash-attn is chosen only where it can run, the folded GQA attention
equals SDPA's own, sliding-window and soft-capped attention match transformers' eager
attention, dynamic RoPE keeps a model off the static path, buckets are capped and ordered
for capture, the activation reserve grows with what a step can hold, and the SDPA kernels
are chosen by the config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.engine.conftest import TINY, greedy_reference, make_engine, save_tiny
from tests.engine.test_engine import drain, prompts_of
from tokenrouter_ray.engine.attention import Variant, _attend, flash_attn_unusable
from tokenrouter_ray.engine.memory_reserve import forward_reserve_bytes
from tokenrouter_ray.engine.model_runner import ModelRunner
from tokenrouter_ray.engine.random_model import save_windowed
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.static_forward import static_shapes, width_buckets

# ---------------------------------------------------------------- 1. warm-up and capture


def test_warm_up_of_every_bucket_writes_only_the_scratch_block(tiny_model_dir) -> None:
    """Warm-up (what capture runs for real) on buffers that start as padding: every K/V
    outside the scratch block is unchanged, the scratch block was written."""
    model = make_engine(tiny_model_dir, num_blocks=8).runner.model
    runner = ModelRunner(model, num_blocks=8, block_size=4, static_batches=True,
                         cuda_graphs=False, max_model_len=32, batch_buckets=(1, 4),
                         query_buckets=(1, 2))  # fmt: skip
    kv = runner.kv
    torch.manual_seed(0)
    for t in (*kv.keys, *kv.values):
        t.normal_()
    before = [t[: runner.scratch_block].clone() for t in (*kv.keys, *kv.values)]
    scratch = [t[runner.scratch_block].clone() for t in kv.keys]
    built = runner.capture_static()
    assert built == len(runner.static) == 2 * 2 * len(runner.width_buckets)
    for fwd in runner.static.values():
        assert (fwd.meta.block_table == runner.scratch_block).all()
        assert (fwd.paged.slot_mapping // kv.block_size == runner.scratch_block).all()
    for old, t in zip(before, (*kv.keys, *kv.values), strict=True):
        assert torch.equal(old, t[: runner.scratch_block])
    assert any(
        not torch.equal(s, t[runner.scratch_block]) for s, t in zip(scratch, kv.keys, strict=True)
    )


def test_buckets_are_capped_and_ordered_largest_first() -> None:
    assert width_buckets(max_blocks=1000, block_size=16, max_context=1024) == (
        1, 2, 4, 8, 16, 32, 64,
    )  # fmt: skip
    assert width_buckets(max_blocks=5, block_size=16) == (1, 2, 4, 5)
    shapes = static_shapes((1, 8, 64), (1, 4), (1, 16, 64), 16, use_flash=False,
                           max_gather_tokens=8 * 64 * 16)  # fmt: skip
    sizes = [b * q * w for b, q, w in shapes]
    assert sizes == sorted(sizes, reverse=True)
    assert all(b * w * 16 <= 8 * 64 * 16 for b, _, w in shapes)
    assert (64, 4, 64) not in shapes and (8, 4, 64) in shapes
    flash = static_shapes((1, 8), (1, 4), (1, 16, 64), 256, use_flash=True)
    assert {w for _, _, w in flash} == {64}  # flash reads the table in place: one width


def test_with_capture_on_an_uncaptured_bucket_takes_the_dynamic_path(tiny_llama_dir) -> None:
    engine = make_engine(tiny_llama_dir, static_batches=True)
    runner = engine.runner
    runner.capture = True  # as on CUDA: only what capture_static built may run static
    (prompt,) = prompts_of([5], seed=1)
    engine.add_request("a", prompt, SamplingParams(max_tokens=4))
    produced = {"a": []}
    drain(engine, produced)
    assert runner.static_steps == 0 and not runner.static


# ------------------------------------------------------------- 2. flash-attn selection


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "capability", "usable"),
    [
        (torch.bfloat16, 128, 256, (9, 0), True),
        (torch.float16, 64, 512, (8, 0), True),
        (torch.float32, 128, 256, (9, 0), False),
        (torch.float64, 128, 256, (9, 0), False),
        (torch.bfloat16, 128, 16, (9, 0), False),
        (torch.bfloat16, 260, 256, (9, 0), False),
        (torch.bfloat16, 100, 256, (9, 0), False),
        (torch.bfloat16, 128, 256, (7, 5), False),
    ],
)
def test_flash_attn_is_chosen_only_where_it_can_run(
    dtype: torch.dtype, head_dim: int, block_size: int, capability: tuple, usable: bool
) -> None:
    why = flash_attn_unusable(torch.device("cuda"), dtype, head_dim, block_size,
                              installed=True, capability=capability)  # fmt: skip
    assert (why is None) == usable, why
    assert flash_attn_unusable(torch.device("cpu"), torch.bfloat16, 128, 256, installed=True)
    assert "not installed" in flash_attn_unusable(torch.device("cuda"), dtype, 128, 256,
                                                  installed=False)  # fmt: skip


# ------------------------------------------------ 3. folded GQA equals SDPA's enable_gqa


def _causal_prefix_mask(n: int, q_len: int, k_len: int) -> torch.Tensor:
    """Rows of sequence i end at a random context length; each row sees keys <= its pos."""
    ctx = torch.randint(q_len, k_len + 1, (n,))
    q_pos = ctx[:, None] - q_len + torch.arange(q_len)[None]  # (n, q_len)
    return (torch.arange(k_len)[None, None] <= q_pos[:, :, None])[:, None]  # (n,1,q,k)


@pytest.mark.parametrize(("heads", "kv_heads", "q_len"), [(8, 2, 1), (8, 2, 4), (4, 4, 3)])
def test_folded_gqa_attention_equals_sdpa_enable_gqa(heads: int, kv_heads: int, q_len: int) -> None:
    torch.manual_seed(heads + q_len)
    n, k_len, d = 3, 24, 16
    q = torch.randn(n, heads, q_len, d, dtype=torch.float64)
    k = torch.randn(n, kv_heads, k_len, d, dtype=torch.float64)
    v = torch.randn(n, kv_heads, k_len, d, dtype=torch.float64)
    mask = _causal_prefix_mask(n, q_len, k_len)
    got = _attend(q, k, v, mask, Variant(scale=0.3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                          enable_gqa=heads != kv_heads)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def _eager_reference(q, k, v, mask, scale, window, softcap) -> torch.Tensor:
    """Repeat K/V per group, cap, window, softmax: transformers' eager attention."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = mask.sum(-1, keepdim=True) - 1
    if window is not None:
        mask = mask & (torch.arange(mask.shape[-1]) > q_pos - window)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 2.0), (4, 1.5)])
def test_sliding_window_and_softcap_match_eager_attention(window, softcap) -> None:
    torch.manual_seed(7)
    n, heads, kv_heads, q_len, k_len, d = 2, 4, 2, 3, 20, 8
    q = 3 * torch.randn(n, heads, q_len, d, dtype=torch.float64)
    k = 3 * torch.randn(n, kv_heads, k_len, d, dtype=torch.float64)
    v = torch.randn(n, kv_heads, k_len, d, dtype=torch.float64)
    mask = _causal_prefix_mask(n, q_len, k_len)
    got = _attend(q, k, v, mask, Variant(0.5, window, softcap))
    want = _eager_reference(q, k, v, mask, 0.5, window, softcap)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    plain = _attend(q, k, v, mask, Variant(0.5))
    assert not torch.allclose(got, plain)  # the variant changed the result
    flash = Variant(0.5, window, softcap).flash_kwargs
    assert flash["window_size"] == ((window - 1, 0) if window else (-1, -1))
    assert flash["softcap"] == (softcap or 0.0)


# ------------------------------------------- 5. attention variants in whole models


@pytest.fixture(scope="module")
def variant_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("variants")
    return {  # gemma2's scores bent large enough for the cap to bend them
        arch: save_windowed(tmp / arch, arch, torch.float64, seed, **TINY, head_dim=16)
        for arch, seed in (("mistral", 3), ("gemma2", 4))
    }


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
@pytest.mark.parametrize("static", [False, True])
def test_sliding_window_and_softcap_models_equal_eager_generate(
    variant_models: dict[str, str], arch: str, static: bool
) -> None:
    """Prompts longer than the window, decodes past it, a pause and a 2-token extend:
    the engine's tokens equal transformers' own eager attention, token for token."""
    path = variant_models[arch]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                               attn_implementation="eager").eval()  # fmt: skip
    engine = make_engine(path, static_batches=static)
    prompts = prompts_of([9, 4, 13], seed=11)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8))
    produced: dict[str, list[int]] = {}
    for _ in range(2):
        for out in engine.commit(engine.execute()):
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.pause("r0")
    held = list(engine.requests["r0"].token_ids)
    engine.resume("r0", [7, 8], anchor=len(held) - 1)
    context = [*held[:-1], 7, 8]
    before = len(produced["r0"])
    drain(engine, produced)
    for i, p in enumerate(prompts[1:], start=1):
        assert produced[f"r{i}"] == greedy_reference(ref, p, 8), f"{arch} r{i}"
    remaining = 8 - (len(context) - len(prompts[0]))
    assert produced["r0"][before:] == greedy_reference(ref, context, remaining)
    assert (engine.runner.static_steps > 0) == static


def test_dynamic_rope_keeps_the_model_off_the_static_path(tmp_path: Path) -> None:
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    path = save_tiny(tmp_path / "dyn", "llama", seed=5, rope_parameters=dynamic)
    engine = make_engine(path, static_batches=True, cuda_graphs=True)
    assert not engine.runner.static_enabled and not engine.runner.capture
    assert "dynamic" in engine.runner.static_blocker
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    drain(engine, {"a": []})
    assert engine.runner.static_steps == 0


# ------------------------------------------------------------- 3. the memory reserve


def test_activation_reserve_grows_with_the_step_and_the_graphs() -> None:
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000)  # fmt: skip
    small = forward_reserve_bytes(cfg, 2, 512, 64, 4096, static_rows=512, graphs=False)
    big = forward_reserve_bytes(cfg, 2, 8192, 64, 4096, static_rows=512, graphs=False)
    graphs = forward_reserve_bytes(cfg, 2, 512, 64, 4096, static_rows=512, graphs=True)
    assert 1 << 30 < small < big and small < graphs
    assert big - small >= (8192 - 512) * 3 * 11008 * 2  # at least the MLP activations


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_variant_models_static_forward_never_reads_device_data(
    variant_models: dict[str, str], arch: str
) -> None:
    """As ``test_static_forward_never_reads_device_data_on_the_host`` for the sliding-window
    and soft-capped models (their mask building and the window cut run in the forward)."""
    from tokenrouter_ray.engine.kv_cache import PagedKVCache
    from tokenrouter_ray.engine.static_forward import StaticForward

    model = make_engine(variant_models[arch]).runner.model.to("meta")
    cfg = model.config
    kv = PagedKVCache(cfg.num_hidden_layers, 9, 4, cfg.num_key_value_heads, cfg.head_dim,
                      torch.float64, "meta")  # fmt: skip
    fwd = StaticForward(model.get_decoder(), model.get_output_embeddings(), kv, 4, 2, 4,
                        use_flash=False, scratch_block=8)  # fmt: skip
    with torch.inference_mode():
        fwd._forward()
    assert fwd.logits.shape == (4, cfg.vocab_size) and fwd.logits.device.type == "meta"


def test_attention_sinks_are_refused_not_ignored() -> None:
    from types import SimpleNamespace

    from tokenrouter_ray.engine.attention import paged_attention_forward

    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="s_aux"):
        paged_attention_forward(torch.nn.Identity(), q, kv, kv, None, paged=SimpleNamespace(),
                                s_aux=torch.zeros(4))  # fmt: skip


def test_the_sdpa_backend_is_chosen_and_validated(tiny_llama_dir) -> None:
    """``sdpa_backend`` maps to the kernels allowed on CUDA: cuDNN only when asked for (by
    name, or "auto": PyTorch's own choice); an unknown name is refused; off CUDA a no-op."""
    import contextlib

    from pydantic import ValidationError
    from torch.nn.attention import SDPBackend

    from tokenrouter_ray.engine.attention import sdpa_backends, sdpa_context
    from tokenrouter_ray.engine.config import EngineConfig

    assert EngineConfig(model="m").sdpa_backend == "efficient"
    with pytest.raises(ValidationError):
        EngineConfig(model="m", sdpa_backend="fastest")
    default = sdpa_backends("efficient")
    assert default[:2] == (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    assert SDPBackend.CUDNN_ATTENTION not in default
    assert sdpa_backends("math") == (SDPBackend.MATH,)
    assert sdpa_backends("flash")[0] == SDPBackend.FLASH_ATTENTION
    assert sdpa_backends("cudnn")[0] == SDPBackend.CUDNN_ATTENTION
    assert sdpa_backends("auto") is None
    with pytest.raises(ValueError, match="sdpa_backend"):
        sdpa_backends("fastest")
    assert isinstance(sdpa_context(default, torch.device("cpu")), contextlib.nullcontext)
    engine = make_engine(tiny_llama_dir, sdpa_backend="math")
    assert engine.runner.sdpa_backend == "math"
    assert engine.runner.sdpa_backends == (SDPBackend.MATH,)
