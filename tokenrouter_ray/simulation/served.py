"""Simulated models behind the real app: what ``models=sim_paper`` (``conf/sim_paper.yaml``) runs.

A model whose ``ModelSpec.sim`` is set is served by the real ``ModelServer`` deployment, the
real ``Replica`` step thread, ``Engine`` and ``Scheduler``, over the real transport and
behind the real ingress (HTTP, SSE), but its forward is a ``SimRunner`` step that takes the
profiled time on a simulated device (``simulation/backend.py``). No model files are needed:
the ingress tokenizes with ``sim_tokenizer()``, a byte-level tokenizer built in memory, and
the simulated models write readable filler text (``FILLER``), never EOS, so an answer lasts
``max_tokens``.

Profiles (``SimSpec.profile``), each a step time per batch size per model, by position
(entry model first):
- ``paper``: the TokenRouter paper's R2R setting, 6.0 ms and 27.9 ms, flat in batch size;
- ``h200``: Qwen3-0.6B and Qwen3-32B decode on one H200 each, from the bandwidth floor
  (bf16 weights plus the batch's KV at ``H200_CONTEXT`` tokens read once per step at
  ``H200_BANDWIDTH``) plus a stated fixed overhead per step (kernel launches and the sampler
  under CUDA graphs: ``H200_OVERHEAD_MS``). Replace it with a measured profile once a GPU run
  exists (``tokenrouter-ray profile`` writes one; pass its path);
- ``zero``: 1 µs steps (the runtime's own cost is all that is left to time);
- a path to a profile JSON/YAML (``tuning/profile.py``): its models by name, else position.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from tokenrouter_ray.config import SimSpec
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.scheduler import SchedulerConfig
from tokenrouter_ray.simulation.backend import SimRunner, profile_step_seconds
from tokenrouter_ray.tuning.profile import ModelProfile, load_profile

SIM_PATH = "sim"  # what a simulated model's `path` says (there are no files)
FILLER = "the quick brown fox jumps over the lazy dog. "
SIM_NUM_BLOCKS = 1 << 16
H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e
H200_CONTEXT = 1024  # tokens of context per row the KV read assumes
H200_OVERHEAD_MS = {"qwen3-0.6b": 1.5, "qwen3-32b": 2.5}
# (bf16 weight bytes, KV bytes per token: layers x kv_heads x head_dim x 2 (K, V) x 2 bytes)
H200_SHAPES = {
    "qwen3-0.6b": (0.6e9 * 2, 28 * 8 * 128 * 2 * 2),
    "qwen3-32b": (32.8e9 * 2, 64 * 8 * 128 * 2 * 2),
}
H200_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def h200_model(shape: str) -> ModelProfile:
    """A step-time table for ``shape`` on one H200 (see the module docstring)."""
    weights, kv_per_token = H200_SHAPES[shape]
    overhead = H200_OVERHEAD_MS[shape]
    return ModelProfile(
        shape,
        tuple(
            (b, overhead + (weights + b * H200_CONTEXT * kv_per_token) / H200_BANDWIDTH * 1e3)
            for b in H200_BATCHES
        ),
    )


def profile_models(profile: str) -> list[ModelProfile]:
    """The step-time tables of a named profile or a profile file, entry model first."""
    if profile == "paper":
        return [ModelProfile.constant("small", 6.0), ModelProfile.constant("large", 27.9)]
    if profile == "zero":
        return [ModelProfile.constant("small", 0.001), ModelProfile.constant("large", 0.001)]
    if profile == "h200":
        return [h200_model("qwen3-0.6b"), h200_model("qwen3-32b")]
    if not Path(profile).is_file():
        raise ValueError(
            f"sim profile {profile!r}: not paper, h200 or zero, and no such profile file"
        )
    return list(load_profile(profile).models)


def model_profile(spec: SimSpec, name: str, index: int) -> ModelProfile:
    """The table for model ``name`` (position ``index``) of ``spec.profile``."""
    models = profile_models(spec.profile)
    by_name = {m.name: m for m in models}
    if name in by_name:
        return by_name[name]
    if index < len(models):
        return models[index]
    raise ValueError(f"sim profile {spec.profile!r} has {len(models)} models, not {name!r}")


def sim_answer(prompt_tokens: int, n: int) -> str:
    """What a simulated app answers (greedy or not): ``n`` filler tokens by position after a
    prompt of ``prompt_tokens`` (what an undisturbed run writes, whatever models and replicas
    wrote it)."""
    tok = sim_tokenizer()
    filler = tok.encode(FILLER, add_special_tokens=False)
    return tok.decode([filler[(prompt_tokens + i) % len(filler)] for i in range(n)])


@cache
def sim_tokenizer() -> Any:
    """A byte-level tokenizer built in memory (256 byte tokens and three specials), with a
    plain chat template: what the ingress of a simulated app tokenizes with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
    )
    return fast


def sim_engine_for(
    spec: SimSpec,
    name: str,
    index: int,
    scheduler: SchedulerConfig,
    max_model_len: int | None,
    block_size: int = 16,
    prefix_caching: bool = True,
) -> Engine:
    """The engine a ``ModelServer`` runs for a simulated model."""
    tokenizer = sim_tokenizer()
    filler = tokenizer.encode(FILLER, add_special_tokens=False)
    runner = SimRunner(
        profile_step_seconds(model_profile(spec, name, index), spec.time_scale),
        vocab_size=len(tokenizer),
        max_position_embeddings=max_model_len or 8192,
        token_id=filler[0],
        token_of=lambda position: filler[position % len(filler)],
    )
    config = EngineConfig(
        model=SIM_PATH,
        block_size=block_size,
        num_blocks=SIM_NUM_BLOCKS,
        max_model_len=max_model_len,
        prefix_caching=prefix_caching,
        scheduler=scheduler,
    )
    return Engine(runner, config, SIM_NUM_BLOCKS)
