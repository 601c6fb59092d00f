"""The demo's small model: the large model's first layers plus distilled top layers, saved
as a plain Llama.

``prepare_small_model(large_dir)`` builds once and caches ``<cache>/<large>-exit<k>``: a
standard ``LlamaForCausalLM`` directory (config.json, safetensors, the large model's
tokenizer files) that ``AutoModelForCausalLM`` and our ``Engine`` load like any model.

The small model is the large one cut to ``k + m`` layers. Layers ``0..k-1`` are exact,
frozen copies; layers ``k..k+m-1`` start as copies and are re-trained, with the final norm,
to predict what the whole large model predicts (the tied embeddings / lm_head stay frozen).
Data enter as chat prompts (templates × topics, split by topic into training and held-out
sets). The large model answers them greedily in one batched ``Engine`` run, which hands
back its next-token logits at every answered position (their top-k log-probs are the
distillation targets) while ``Engine.tap_layer(k)`` records the residual stream after layer ``k``
(the trained layers' input). Training therefore never runs the large model again. The build
ends by measuring greedy next-token agreement with the large model on the held-out prompts'
answers (teacher-forced) and writes it, with the recipe, to ``tokenrouter_build.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from tokenrouter_ray.demo.artifacts import (  # the build's readers, which serving needs too
    BUILD_FILE,
    Recipe,
    is_current,
    small_model_dir,
)
from tokenrouter_ray.prompts import TOPICS

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tokenrouter_ray.engine.engine import Engine

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

TEMPLATES = (
    "What is {t}?", "Explain {t} to a ten-year-old.", "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.", "Why is {t} important?",
    "Write a haiku about {t}.", "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few sentences.", "How does {t} work?",
    "Write a short story involving {t}.", "List five words related to {t}.",
    "What would a beginner need to know about {t}?", "Describe {t} in one paragraph.",
    "Tell me a joke about {t}.", "What are common misconceptions about {t}?",
    "Write a tweet about {t}.", "How has {t} changed over time?",
    "Give me a quiz question about {t} with the answer.",
    "Write an email to a friend about {t}.", "What is the future of {t}?",
    "Compare {t} with something similar.", "Can you teach me something about {t}?",
    "Write a product description inspired by {t}.",
    "What questions should I ask an expert on {t}?",
)  # fmt: skip


@dataclass
class Sample:
    """A prompt, the large model's answer, its top-k log-probs and the layer-k states.

    Row ``j`` of ``top_ids`` / ``top_logprobs`` is the distribution that produced
    ``output_ids[j]``: the prediction at input position ``len(prompt_ids) - 1 + j``.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    top_ids: torch.Tensor  # (num_output, top_k) long
    top_logprobs: torch.Tensor  # (num_output, top_k) float
    exit_states: torch.Tensor | None = field(default=None, repr=False)  # (num_input, hidden)

    @property
    def input_ids(self) -> list[int]:
        """The teacher-forced input whose last ``len(output_ids)`` positions are scored."""
        return self.prompt_ids + self.output_ids[:-1]


# ------------------------------------------------------------------------- prompts
def split_topics(topics: Sequence[str] = TOPICS, every: int = 5) -> tuple[list[str], list[str]]:
    """(training topics, held-out topics): every ``every``-th topic is held out."""
    held = [t for i, t in enumerate(topics) if i % every == 0]
    return [t for t in topics if t not in held], held


def chat_prompts(topics: Sequence[str], n: int, seed: int) -> list[str]:
    """``n`` distinct prompts, templates × ``topics``, in a seeded order."""
    pairs = [(template, topic) for topic in topics for template in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return [template.format(t=topic) for template, topic in pairs[:n]]


def encode_chat(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ------------------------------------------------------------------------ teacher
def teacher_samples(
    engine: Engine,  # with keep_logits=True
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    top_k: int,
    exit_layer: int | None = None,
    on_tokens: Callable[[int], None] = lambda n: None,
) -> list[Sample]:
    """Greedy answers to ``prompts`` in one batched run, with the top-k log-probs of every
    answer token and, given ``exit_layer``, the residual stream after that layer."""
    from contextlib import nullcontext

    from tokenrouter_ray.engine.request import SamplingParams

    ids = [f"pair-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    tops: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {rid: [] for rid in ids}
    tap = engine.tap_layer(exit_layer) if exit_layer else None
    with tap or nullcontext():
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
        while engine.has_unfinished:
            result = engine.execute()
            if result is None:
                continue
            logits = result.logits  # (num_rows, vocab)
            top = logits.topk(top_k, dim=-1)
            logprobs = top.values - logits.logsumexp(-1, keepdim=True)  # (num_rows, top_k)
            for row, rid in enumerate(result.request_ids):
                tops[rid].append((top.indices[row], logprobs[row]))
            committed = engine.commit(result)
            for out in committed:
                outputs[out.request_id].extend(out.new_token_ids)
            on_tokens(len(committed))
    samples = []
    for rid, prompt in zip(ids, prompts, strict=True):
        sample = Sample(
            list(prompt),
            outputs[rid],
            torch.stack([i for i, _ in tops[rid]]),
            torch.stack([v for _, v in tops[rid]]),
        )
        if tap is not None:
            sample.exit_states = tap.states(rid, len(sample.input_ids))
        samples.append(sample)
    return samples


# ------------------------------------------------------------------------ dtype
def native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (AVX512-BF16 or AMX) and torch
    dispatches to its AVX-512 kernels. Elsewhere (AVX2-only hosts) bf16 is emulated and a
    distillation step under bf16 autocast is about 10x slower than in fp32."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def train_dtype() -> torch.dtype:
    """bf16 where the CPU computes it natively, else fp32 (``TOKENROUTER_TRAIN_DTYPE``
    = ``bf16`` / ``fp32`` overrides the choice)."""
    forced = os.environ.get("TOKENROUTER_TRAIN_DTYPE", "").lower()
    if forced in ("bf16", "bfloat16"):
        return torch.bfloat16
    if forced in ("fp32", "float32"):
        return torch.float32
    if forced:
        raise ValueError(f"TOKENROUTER_TRAIN_DTYPE={forced!r}: use bf16 or fp32")
    return torch.bfloat16 if native_bf16() else torch.float32


# ---------------------------------------------------------------------- small model
def make_small_model(large: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The large model cut to its first ``num_layers`` layers: same class, copied weights."""
    config = large.config.__class__.from_dict(large.config.to_dict())
    config.num_hidden_layers = num_layers
    small = type(large)(config).to(next(large.parameters()).dtype)
    keep = {}
    for name, tensor in large.state_dict().items():
        parts = name.split(".")
        if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
            continue
        keep[name] = tensor
    small.load_state_dict(keep, strict=True)
    small.generation_config = large.generation_config
    return small.eval()


def _length_batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _top_hidden(small: PreTrainedModel, k: int, batch: Sequence[Sample]) -> torch.Tensor:
    """The small model's layers ``k..`` and final norm on cached layer-k states.

    Returns the normed hidden state at every scored position, (num_scored, hidden). Rows are
    right-padded: under the causal mask no real token attends to a pad.
    """
    decoder = small.get_decoder()
    seq = max(len(s.input_ids) for s in batch)
    hidden = torch.zeros(len(batch), seq, decoder.config.hidden_size)  # (batch, seq, hidden)
    for row, s in enumerate(batch):
        hidden[row, : len(s.input_ids)] = s.exit_states.float()
    positions = torch.arange(seq)[None]
    rope = decoder.rotary_emb(hidden, positions)
    for layer in decoder.layers[k:]:
        hidden = layer(hidden, position_embeddings=rope, position_ids=positions)
    scored = [
        hidden[row, len(s.input_ids) - len(s.output_ids) : len(s.input_ids)]
        for row, s in enumerate(batch)
    ]
    return decoder.norm(torch.cat(scored))


def _distill_loss(
    hidden: torch.Tensor,  # (num_scored, hidden) normed, fp32
    unembed: torch.Tensor,  # (vocab, hidden) in the training dtype, frozen
    top_ids: torch.Tensor,  # (num_scored, top_k)
    top_logprobs: torch.Tensor,  # (num_scored, top_k)
    recipe: Recipe,
    gen: torch.Generator,
) -> torch.Tensor:
    """Soft cross-entropy to the teacher's top-k plus hard CE on its greedy token.

    The softmax runs over the batch's teacher candidates plus random negatives, the latter
    corrected by the log of their sampling ratio: several times cheaper than the whole
    vocabulary, and as good in our runs.
    """
    candidates = top_ids.flatten().unique()  # sorted
    rest = torch.ones(unembed.shape[0], dtype=torch.bool)
    rest[candidates] = False
    rest_ids = rest.nonzero()[:, 0]
    negatives = rest_ids[torch.randperm(len(rest_ids), generator=gen)[: recipe.negatives]]
    rows = torch.cat([candidates, negatives])
    logits = (hidden.to(unembed.dtype) @ unembed[rows].T).float()  # (num_scored, num_rows)
    if len(negatives):
        logits[:, len(candidates) :] += math.log(len(rest_ids) / len(negatives))
    picked = logits.log_softmax(-1).gather(1, torch.searchsorted(candidates, top_ids))
    soft = -(top_logprobs.exp() * picked).sum(-1).mean()
    return soft - recipe.hard_weight * picked[:, 0].mean()


def distill(
    small: PreTrainedModel,
    samples: Sequence[Sample],
    recipe: Recipe,
    on_batch: Callable[[int, float], None] = lambda tokens, loss: None,
) -> list[float]:
    """Train the small model's layers ``k..`` and final norm on samples with exit states.

    Returns the mean loss of each epoch.
    """
    k = recipe.exit_layer
    decoder = small.get_decoder()
    small.requires_grad_(False)
    params = [*decoder.layers[k:].parameters(), *decoder.norm.parameters()]
    for p in params:
        p.requires_grad_(True)
    dtype = train_dtype()
    unembed = small.get_output_embeddings().weight.detach().to(dtype)
    batches = _length_batches([len(s.input_ids) for s in samples], recipe.batch_seqs)
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=recipe.lr, total_steps=recipe.epochs * len(batches), pct_start=0.1
    )
    rng = random.Random(recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    losses = []
    small.train()
    for _ in range(recipe.epochs):
        rng.shuffle(batches)
        total = 0.0
        for idx in batches:
            batch = [samples[i] for i in idx]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                hidden = _top_hidden(small, k, batch)
            loss = _distill_loss(
                hidden.float(),
                unembed,
                torch.cat([s.top_ids for s in batch]),
                torch.cat([s.top_logprobs for s in batch]),
                recipe,
                gen,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            total += loss.item()
            on_batch(sum(len(s.output_ids) for s in batch), loss.item())
        losses.append(total / len(batches))
    small.requires_grad_(False)
    small.eval()
    return losses


@torch.inference_mode()
def agreement(
    model: PreTrainedModel, samples: Sequence[Sample], batch: int = 16
) -> dict[str, float]:
    """Greedy next-token agreement of ``model`` with the samples' answers, teacher-forced.

    Also the mean normalized entropy of ``model``'s next-token distribution where it agrees
    and where it does not (a routing signal: low means confident).
    """
    right = wrong = 0
    entropy_right = entropy_wrong = 0.0
    for idx in _length_batches([len(s.input_ids) for s in samples], batch):
        seqs = [samples[i].input_ids for i in idx]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # right-padded
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = torch.tensor(s)
        logits = model(input_ids=ids).logits.float()  # (batch, seq, vocab)
        for row, i in enumerate(idx):
            s = samples[i]
            end = len(s.input_ids)
            z = logits[row, end - len(s.output_ids) : end]  # (num_output, vocab)
            hit = z.argmax(-1) == torch.tensor(s.output_ids)
            logp = z.log_softmax(-1)
            entropy = -(logp.exp() * logp).sum(-1) / math.log(z.shape[-1])
            right += int(hit.sum())
            wrong += int((~hit).sum())
            entropy_right += float(entropy[hit].sum())
            entropy_wrong += float(entropy[~hit].sum())
    return {
        "agreement": right / max(right + wrong, 1),
        "tokens": right + wrong,
        "entropy_when_agreeing": entropy_right / max(right, 1),
        "entropy_when_disagreeing": entropy_wrong / max(wrong, 1),
    }


# --------------------------------------------------------------------------- build
def prepare_small_model(
    large_dir: Path | str, force: bool = False, quiet: bool = False, recipe: Recipe = Recipe()
) -> Path:
    """Build (once) and return the HF directory of the small model for ``large_dir``."""
    large_dir = Path(large_dir)
    target = small_model_dir(large_dir, recipe)
    if not force and is_current(target, recipe):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / "model"
        info = build_small_model(large_dir, staging, recipe, quiet)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    if not quiet:
        held = info["heldout"]
        print(
            f"small model: {recipe.num_layers} of {info['large_layers']} layers; greedy "
            f"agreement with the large model on held-out prompts {held['agreement']:.1%} "
            f"({held['tokens']} tokens); built in {info['build_seconds']:.0f} s -> {target}"
        )
    return target


def build_small_model(large_dir: Path, out: Path, recipe: Recipe, quiet: bool = False) -> dict:
    """Generate teacher data, distill, evaluate and save into ``out``; returns the build info."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine
    from tokenrouter_ray.engine.scheduler import SchedulerConfig

    t0 = time.perf_counter()
    torch.manual_seed(recipe.seed)
    train_topics, heldout_topics = split_topics(TOPICS, recipe.heldout_every)
    train_text = chat_prompts(train_topics, recipe.train_prompts, recipe.seed)
    heldout_text = chat_prompts(heldout_topics, recipe.eval_prompts, recipe.seed + 1)
    tokenizer = AutoTokenizer.from_pretrained(large_dir)
    prompts = [encode_chat(tokenizer, p) for p in train_text + heldout_text]
    answer_tokens = len(prompts) * recipe.max_tokens  # at most: some answers stop at EOS
    # Progress in tokens: answers generated, then answer tokens trained on, epoch by epoch.
    bar = tqdm(
        total=answer_tokens * (1 + recipe.epochs), desc="prepare-demo-pair", unit="tok",
        unit_scale=True, disable=quiet,
    )  # fmt: skip
    timings: dict[str, float] = {}

    def lap(stage: str) -> None:
        timings[stage] = round(time.perf_counter() - t0 - sum(timings.values()), 1)

    bar.set_postfix_str("large model answers")
    engine = Engine.from_config(
        EngineConfig(
            model=str(large_dir),
            keep_logits=True,
            # 256 answers at a time: 321 tok/s on 2 cores at AVX2 (imitated), against 283
            # at 128 and 244 at 512 (512 prompts; teacher answers, prompt and answer tokens)
            scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
        )
    )
    samples = teacher_samples(
        engine, prompts, recipe.max_tokens, recipe.top_k, recipe.exit_layer, bar.update
    )
    del engine
    train, heldout = samples[: len(train_text)], samples[len(train_text) :]
    train_tokens = sum(len(s.output_ids) for s in train)
    bar.total = bar.n + train_tokens * recipe.epochs
    lap("generate")

    large = AutoModelForCausalLM.from_pretrained(large_dir, dtype=torch.float32)
    small = make_small_model(large, recipe.num_layers)
    large_layers = large.config.num_hidden_layers
    del large

    def on_batch(tokens: int, loss: float) -> None:
        bar.set_postfix_str(f"distill, loss {loss:.2f}", refresh=False)
        bar.update(tokens)

    losses = distill(small, train, recipe, on_batch)
    lap("distill")

    bar.set_postfix_str("held-out agreement")
    heldout_stats = agreement(small, heldout)
    lap("evaluate")

    small.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (large_dir / name).is_file():
            shutil.copy2(large_dir / name, out / name)
    info = {
        "large_model": str(large_dir),
        "large_layers": large_layers,
        "small_layers": recipe.num_layers,
        "recipe": dataclasses.asdict(recipe),
        "heldout": heldout_stats,
        "train_answer_tokens": train_tokens,
        "epoch_losses": [round(x, 3) for x in losses],
        "train_topics": train_topics,
        "heldout_topics": heldout_topics,
        "train_prompts": train_text,
        "heldout_prompts": heldout_text,
        "timings_s": timings,
        "build_seconds": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "train_dtype": str(train_dtype()).removeprefix("torch."),
    }
    (out / BUILD_FILE).write_text(json.dumps(info, indent=1) + "\n")
    bar.close()
    return info
