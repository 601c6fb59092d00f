"""Router training data: prompts, the large model's own continuations, and per-position
features and labels computed by teacher forcing.

Data enters as prompts (chat text through the tokenizer's chat template, or token-id lists
directly) and leaves as a ``RouterData``: one row per output position of every sequence
``prompt + the large model's greedy continuation``, holding exactly what the runtime's
``RouteBatch`` shows the small model's router at that position (last hidden state after the
final norm, top-k raw logits, embedding of the small model's greedy token) plus the facts
the labels are made of (small and large tokens, both models' log-probability of the large
token). Features come from ONE teacher-forced forward per sequence (batched, right-padded:
a causal model never looks at the padding after a token), never token by token.

Labels (``labels(policy, data)``):
- r2r: 1 where the small model's greedy token differs from the large model's (it would
  diverge there). ``verify_divergences`` optionally keeps only divergences that matter.
- citer: 1 where the small model's token is acceptable (equals the large model's).
- co_llm: 1 (defer) where the large model gives the gold token (its own continuation)
  a higher probability than the small model does (Co-LLM's weak initial labels), by more
  than ``COLLM_MARGIN`` so float noise between equal predictions never counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.errors import ModelLoadError, UserFacingError
from tokenrouter_ray.prompts import TOPICS

POLICY_LABELS = {
    "r2r": "small greedy token != large token (divergence)",
    "citer": "small greedy token == large token (small is acceptable)",
    "co_llm": "p_large(gold) > p_small(gold), gold = large model's token (defer)",
}

COLLM_MARGIN = 1e-4  # nats: float noise between equal predictions is not a preference

# ----------------------------------------------------------------------------- prompts
TEMPLATES = (
    "Explain {t} in simple terms.",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "What is the history of {t}?",
    "List the pros and cons of {t}.",
    "How would you explain {t} to a ten-year-old?",
    "Write a haiku about {t}.",
    "Summarize the main ideas behind {t} in two sentences.",
    "What are common misconceptions about {t}?",
    "Write the opening of a short story that involves {t}.",
    "Why does {t} matter today?",
    "Describe {t} to someone who has never heard of it.",
    "What questions would a student ask about {t}?",
    "Compare {t} and {u}.",
)
ARITHMETIC = (
    "What is {a} + {b}?",
    "What is {a} times {b}?",
    "If I have {a} apples and give away {b}, how many do I have left?",
    "A train travels {a} km in {b} hours. What is its average speed?",
)
CODING = (
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "How do I read a file line by line in Python?",
    "Write a Python function that returns the largest element of a list.",
    "What is the difference between a list and a tuple in Python?",
    "Write a SQL query that counts the rows of a table named users.",
    "Explain what a for loop does, with an example.",
    "Write a Python function that computes the factorial of n.",
)


STYLES = ("", " Answer briefly.", " Use an example.", " Answer as a numbered list.")


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` varied user prompts (templates x topics, some arithmetic and code), no I/O.

    Topics are the demo builder's (``tokenrouter_ray.prompts.TOPICS``). Distinct up to
    ~18,000 (~4,500 before the style suffixes); past that the list repeats
    (``train_router`` drops repeats).
    """
    rng = random.Random(seed)
    base = [
        tpl.format(t=t, u=rng.choice([u for u in TOPICS if u != t]))
        for tpl in TEMPLATES
        for t in TOPICS
    ]
    base += list(
        dict.fromkeys(
            rng.choice(ARITHMETIC).format(a=rng.randint(2, 99), b=rng.randint(2, 20))
            for _ in range(len(base) // 10)
        )
    )
    base += list(CODING)
    pool = []
    for style in STYLES:  # plain prompts first, then restyled ones
        tier = [text + style for text in base]
        rng.shuffle(tier)
        pool += tier
    return [pool[i % len(pool)] for i in range(n)]


def encode_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Chat template with the generation prompt when the tokenizer has one, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        out = []
        for text in texts:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out
    return [tokenizer.encode(text) for text in texts]


# ------------------------------------------------------------------------------ models
def check_model_dir(path: str, role: str) -> None:
    """A clear error before any heavy work when a model directory is wrong."""
    if not Path(path).expanduser().is_dir():
        raise UserFacingError(f"{role} model directory {path!r} does not exist")
    try:
        AutoConfig.from_pretrained(str(Path(path).expanduser()))
    except (OSError, ValueError) as exc:
        raise UserFacingError(f"{role} model {path!r} has no readable config: {exc}") from exc


def load_feature_model(
    path: str, num_hidden_layers: int | None = None, device: str = "cpu"
) -> PreTrainedModel:
    """The plain transformers model (SDPA attention) for teacher-forced forwards, fp32."""
    overrides = {} if num_hidden_layers is None else {"num_hidden_layers": num_hidden_layers}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(Path(path).expanduser()), dtype=torch.float32, attn_implementation="sdpa",
            **overrides,
        )  # fmt: skip
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {path!r} as a causal LM: {exc}") from exc
    return model.to(device).eval()


def eos_token_ids(model: PreTrainedModel) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


def run_engine(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    desc: str,
    progress: bool = True,
) -> list[list[int]]:
    """Greedy continuations of all prompts, batched by the engine, with a token progress bar."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [engine.add_request(f"{desc}-{i}", p, sampling).request_id for i, p in enumerate(prompts)]
    produced: dict[str, list[int]] = {rid: [] for rid in ids}
    with tqdm(total=len(ids) * max_tokens, desc=desc, unit="tok", disable=not progress) as bar:
        while engine.has_unfinished:
            for out in engine.step():
                produced[out.request_id].extend(out.new_token_ids)
                bar.update(len(out.new_token_ids))
                if out.finished:  # the tokens it will not produce
                    bar.update(max_tokens - len(produced[out.request_id]))
    return [produced[rid] for rid in ids]


# ---------------------------------------------------------------------------- features
@dataclass
class RouterData:
    """One row per output position (the position the runtime routes), all on the CPU."""

    prompt_index: torch.Tensor  # (N,) long: which prompt the row belongs to
    seq_position: torch.Tensor  # (N,) long: index of the routed token in its sequence
    hidden: torch.Tensor  # (N, H) small model's last hidden state (after the final norm)
    token_embedding: torch.Tensor  # (N, H) embedding of the small model's greedy token
    top_logits: torch.Tensor  # (N, K) small model's raw logits, top-k, sorted descending
    small_token: torch.Tensor  # (N,) long: small model's greedy token
    large_token: torch.Tensor  # (N,) long: the large model's token (teacher-forced gold)
    small_logprob: torch.Tensor  # (N,) small model's log p(gold)
    large_logprob: torch.Tensor  # (N,) large model's log p(gold); NaN when not computed

    @property
    def size(self) -> int:
        return self.prompt_index.numel()


def _batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Sequence indices grouped by similar length, each group under the padded budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _output_logits(model: PreTrainedModel, rows: torch.Tensor) -> torch.Tensor:
    """lm_head on selected hidden rows, as the engine's runner computes step logits."""
    logits = model.get_output_embeddings()(rows).float()  # (n, V)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


@torch.no_grad()  # not inference_mode: the rows become training inputs
def teacher_forced_features(
    small: PreTrainedModel,
    sequences: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    top_k: int = 100,
    large: PreTrainedModel | None = None,
    token_budget: int = 4096,
    progress: bool = True,
) -> RouterData:
    """Small-model features at every output position of every sequence (and the large
    model's log-probability of the gold token when ``large`` is given)."""
    vocab = small.get_output_embeddings().weight.shape[0]
    if top_k > vocab:
        raise UserFacingError(f"top_k {top_k} exceeds the vocabulary size {vocab}")
    device = next(small.parameters()).device
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in RouterData.__dataclass_fields__}
    lengths = [len(s) for s in sequences]
    groups = _batches(lengths, token_budget)
    for group in tqdm(groups, desc="features", unit="batch", disable=not progress):
        width = max(lengths[i] for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)  # right padding
        b_idx, t_idx, gold, prompt_of = [], [], [], []
        for b, i in enumerate(group):
            ids[b, : lengths[i]] = torch.tensor(sequences[i])
            for q in range(num_prompt_tokens[i], lengths[i]):  # q: routed token's index
                b_idx.append(b)
                t_idx.append(q - 1)  # the hidden state that predicts token q
                gold.append(sequences[i][q])
                prompt_of.append(i)
        ids = ids.to(device)
        b_t, t_t = torch.tensor(b_idx), torch.tensor(t_idx)
        gold_t = torch.tensor(gold, device=device)
        hidden_all = small.get_decoder()(input_ids=ids).last_hidden_state  # (B, L, H)
        hidden = hidden_all[b_t, t_t]  # (n, H)
        logits = _output_logits(small, hidden)  # (n, V)
        logp = torch.log_softmax(logits, dim=-1)
        small_token = logits.argmax(-1)  # greedy, as the engine's sampler
        parts["prompt_index"].append(torch.tensor(prompt_of))
        parts["seq_position"].append(t_t + 1)
        parts["hidden"].append(hidden.float().cpu())
        parts["token_embedding"].append(small.get_input_embeddings()(small_token).float().cpu())
        parts["top_logits"].append(logits.topk(top_k, dim=-1).values.cpu())
        parts["small_token"].append(small_token.cpu())
        parts["large_token"].append(gold_t.cpu())
        parts["small_logprob"].append(logp.gather(1, gold_t[:, None])[:, 0].cpu())
        if large is not None:
            rows = large.get_decoder()(input_ids=ids).last_hidden_state[b_t, t_t]
            large_logp = torch.log_softmax(_output_logits(large, rows), dim=-1)
            parts["large_logprob"].append(large_logp.gather(1, gold_t[:, None])[:, 0].cpu())
        else:
            parts["large_logprob"].append(torch.full((len(gold),), float("nan")))
    return RouterData(**{k: torch.cat(v) for k, v in parts.items()})


# ------------------------------------------------------------------------------ labels
def labels(policy: str, data: RouterData) -> torch.Tensor:
    """(N,) float 0/1 training target of the policy's router (see the module docstring)."""
    if policy == "r2r":
        return (data.small_token != data.large_token).float()
    if policy == "citer":
        return (data.small_token == data.large_token).float()
    if policy == "co_llm":
        if torch.isnan(data.large_logprob).any():
            raise ValueError("co_llm labels need the large model's log-probabilities")
        return (data.large_logprob > data.small_logprob + COLLM_MARGIN).float()
    raise UserFacingError(f"no router training for policy {policy!r}; choose r2r, citer, co_llm")


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Longest common subsequence of two short token lists."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def verify_divergences(
    continue_fn: Callable[[list[list[int]], int], list[list[int]]],
    sequences: Sequence[Sequence[int]],
    data: RouterData,
    steps: int,
    eos_ids: set[int],
    min_overlap: float = 0.5,
) -> torch.Tensor:
    """R2R labels keeping only divergences that matter (a cheap stand-in for the paper's
    verifier LLM): at each divergence the large model continues ``prefix + small token``
    for ``steps`` tokens; the divergence is neutral (label 0) when that continuation
    recovers at least ``min_overlap`` of the large model's own next ``steps`` tokens, in
    order (LCS). A small EOS where the large model went on, or the reverse, is critical.
    ``continue_fn(prompts, steps)`` returns greedy large-model continuations."""
    label = (data.small_token != data.large_token).float()
    rows = torch.nonzero(label).flatten().tolist()
    prefixes, checks = [], []
    for r in rows:
        seq = sequences[int(data.prompt_index[r])]
        q, s = int(data.seq_position[r]), int(data.small_token[r])
        reference = list(seq[q + 1 : q + 1 + steps])
        if s in eos_ids or seq[q] in eos_ids or not reference:
            continue  # one of them ends the response here: critical, keep label 1
        prefixes.append([*seq[:q], s])
        checks.append((r, reference))
    if prefixes:
        for (r, reference), cont in zip(checks, continue_fn(prefixes, steps), strict=True):
            if lcs_length(cont[: len(reference)], reference) >= min_overlap * len(reference):
                label[r] = 0.0
    return label
