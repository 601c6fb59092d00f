"""Router training on tiny float32 Llama pairs: labels on constructed cases, features equal
to what the runtime shows a policy, the split by prompt, thresholds, the training loop, a
trained checkpoint routing through its policy, and the CLI's errors."""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.tiny_models import tiny_model
from tokenrouter_ray.demo.router import threshold_at_rate
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.routing.policy import RouteBatch, build_policy
from tokenrouter_ray.routing.routers import HiddenMLPRouter, load_router
from tokenrouter_ray.routing.training import commands, train_router
from tokenrouter_ray.routing.training.data import (
    RouterData,
    chat_prompts,
    encode_prompts,
    labels,
    lcs_length,
    verify_divergences,
)
from tokenrouter_ray.routing.training.train import (
    POLICIES,
    TrainOptions,
    build_data,
    evaluate,
    fit,
    predict,
    routes,
    split_by_prompt,
    threshold_for_rate,
)

MAX_TOKENS = 12
TOP_K = 20


def make_prompts(n: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(rng.randint(2, 12))] for _ in range(n)]


def engine(path: str, **kwargs: object) -> Engine:
    return Engine.from_config(EngineConfig(model=path, block_size=4, num_blocks=512, **kwargs))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from threads, and lose a lot on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """``large``: a tiny float32 Llama with peaked distributions. ``swapped``: the same model
    with lm_head rows of tokens a and b exchanged, so it disagrees with ``large`` exactly
    where the large model's greedy token is a or b (a: its most frequent output token)."""
    root = tmp_path_factory.mktemp("training_pair")
    model = tiny_model("llama", seed=5, initializer_range=0.4).float()
    model.save_pretrained(root / "large")
    outputs = engine(str(root / "large")).generate(
        make_prompts(), SamplingParams(max_tokens=MAX_TOKENS)
    )
    counts = Counter(t for out in outputs for t in out).most_common()
    a, b = counts[0][0], counts[-1][0]
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[[a, b]] = head[[b, a]].clone()
    model.save_pretrained(root / "swapped")
    return {"large": str(root / "large"), "swapped": str(root / "swapped"), "ab": (a, b)}


def options(**kw: object) -> TrainOptions:
    return TrainOptions(
        prompts=make_prompts(), max_tokens=MAX_TOKENS, top_k=TOP_K, progress=False, **kw
    )


@pytest.fixture(scope="module")
def swapped_data(pair: dict) -> tuple[RouterData, torch.Tensor]:
    data, _, _ = build_data("co_llm", pair["swapped"], pair["large"], options())
    return data


# ------------------------------------------------------------------------------ labels
def test_identical_models_give_no_positives(pair: dict) -> None:
    data, target, _ = build_data("co_llm", pair["large"], pair["large"], options())
    assert data.size == len(make_prompts()) * MAX_TOKENS  # every output position, once
    assert torch.equal(data.small_token, data.large_token)  # teacher forcing == engine
    assert labels("r2r", data).sum() == 0
    assert labels("citer", data).min() == 1
    assert target.sum() == 0  # co_llm: the assistant is never strictly more confident
    gold = engine(pair["large"]).generate(make_prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, out in enumerate(gold):
        rows = data.prompt_index == i
        order = data.seq_position[rows].argsort()
        assert data.large_token[rows][order].tolist() == out


def test_known_disagreements_are_labelled(pair: dict, swapped_data: RouterData) -> None:
    data = swapped_data
    expected = torch.isin(data.large_token, torch.tensor(pair["ab"])).float()
    assert expected.sum() >= 3
    assert torch.equal(labels("r2r", data), expected)
    assert torch.equal(labels("citer", data), 1 - expected)
    assert torch.equal(labels("co_llm", data), expected)


def test_features_match_the_runtime_step(pair: dict, swapped_data: RouterData) -> None:
    """What the small model's engine step shows a policy equals the teacher-forced row."""
    data = swapped_data
    eng = engine(pair["swapped"], keep_logits=True, keep_hidden=True)
    prompts = make_prompts()
    rows = list(range(0, data.size, 7))
    for n, r in enumerate(rows):
        prompt = prompts[int(data.prompt_index[r])]
        gold = data.large_token[data.prompt_index == data.prompt_index[r]]
        order = data.seq_position[data.prompt_index == data.prompt_index[r]].argsort()
        prefix = prompt + gold[order].tolist()[: int(data.seq_position[r]) - len(prompt)]
        eng.add_request(f"r{n}", prefix, SamplingParams(max_tokens=1))
    step = eng.execute()
    embed = eng.runner.model.get_input_embeddings()
    with torch.inference_mode():
        embedded = embed(step.sampled)
    for i, r in enumerate(int(rid[1:]) for rid in step.request_ids):
        row = rows[r]
        assert step.token_ids[i] == int(data.small_token[row])
        torch.testing.assert_close(step.hidden[i], data.hidden[row], atol=1e-4, rtol=1e-4)
        top = step.logits[i].topk(TOP_K).values
        torch.testing.assert_close(top, data.top_logits[row], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(embedded[i], data.token_embedding[row])


# ------------------------------------------------------------------ split, thresholds
def test_split_is_disjoint_by_prompt() -> None:
    prompt_index = torch.arange(50).repeat_interleave(torch.randint(1, 9, (50,)))
    train, test = split_by_prompt(prompt_index, 0.2, seed=3)
    assert train.numel() + test.numel() == prompt_index.numel()
    train_prompts, test_prompts = (
        set(prompt_index[train].tolist()),
        set(prompt_index[test].tolist()),
    )
    assert not train_prompts & test_prompts
    assert len(test_prompts) == 10 and len(train_prompts) == 40


@pytest.mark.parametrize("policy", POLICIES)
def test_threshold_routes_the_target_rate(policy: str) -> None:
    scores = torch.rand(1000, generator=torch.Generator().manual_seed(1))
    for rate in (0.1, 0.3, 0.75):
        t = threshold_for_rate(policy, scores, rate)
        assert 0 <= t <= 1
        assert routes(policy, scores, t).float().mean() == pytest.approx(rate, abs=1e-3)


def test_a_threshold_named_by_rate_routes_that_rate_from_the_stored_quantiles() -> None:
    """The demo names its thresholds by route rate (``${demo:router_threshold,RATE}``):
    from the 101 held-out score quantiles ``evaluate`` stores, the threshold for a rate
    routes about that rate of the scores themselves."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2000, generator=gen) * 3
    target = (torch.rand(2000, generator=gen) < 0.4).float()
    metrics = evaluate("r2r", logits, target, 0.3, target)
    quantiles = metrics["test_score_quantiles"]
    assert len(quantiles) == 101 and quantiles == sorted(quantiles)
    scores = torch.sigmoid(logits)
    for rate in (0.05, 0.3, 0.5, 0.93, 1.0):
        t = threshold_at_rate(quantiles, rate)
        assert routes("r2r", scores, t).float().mean() == pytest.approx(rate, abs=0.011)
    assert threshold_at_rate(quantiles, 0.3) == pytest.approx(
        metrics["threshold_for_rate"], abs=0.01
    )
    with pytest.raises(UserFacingError, match="route rate"):
        threshold_at_rate(quantiles, 1.5)


# -------------------------------------------------------------------------- training
def test_fit_learns_a_synthetic_signal() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3000, 16, generator=gen)
    target = (hidden[:, 0] + 0.5 * hidden[:, 1] > 1.0).float()  # ~19% positives
    prompt_index = torch.arange(3000) // 10
    train, test = split_by_prompt(prompt_index, 0.25, seed=0)
    torch.manual_seed(0)
    module = HiddenMLPRouter(16, width=32)
    losses = fit(module, (hidden,), target, train, epochs=20, lr=1e-2, progress=False)
    assert losses[-1] < 0.5 * losses[0]
    predicted = predict(module, (hidden,), test) > 0
    accuracy = (predicted == target[test].bool()).float().mean()
    majority = max(target[test].mean(), 1 - target[test].mean())
    assert accuracy > majority + 0.1


def test_single_class_labels_are_a_clear_error() -> None:
    with pytest.raises(UserFacingError, match="nothing to learn"):
        fit(HiddenMLPRouter(4), (torch.randn(8, 4),), torch.zeros(8), torch.arange(8), 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_trained_router_routes_through_its_policy(
    policy: str, pair: dict, swapped_data: RouterData, tmp_path: Path
) -> None:
    path = tmp_path / f"{policy}.pt"
    metrics = train_router(
        policy, pair["swapped"], pair["large"], str(path), prompts=make_prompts(),
        max_tokens=MAX_TOKENS, top_k=TOP_K, epochs=20, batch_size=32, lr=3e-3, progress=False,
    )  # fmt: skip
    module, stored = load_router(path, "r2r" if policy == "r2r" else "hidden_mlp")
    assert stored == metrics and 0 <= metrics["threshold_for_rate"] <= 1
    assert metrics["test_prompts"] == 4 and metrics["positions"] == swapped_data.size
    if policy == "r2r":  # the swap is visible in the small token's embedding: learnable
        assert metrics["auc"] > 0.8

    threshold = metrics["threshold_for_rate"]
    options = {"checkpoint": str(path), "threshold": threshold}
    routing = build_policy(policy, options, ["small", "large"])
    eng = engine(pair["swapped"], keep_logits=True, keep_hidden=True)
    prompts = make_prompts()
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=1))
    step = eng.execute()
    batch = RouteBatch(
        model=0,
        step=step,
        positions=torch.tensor(step.positions),
        prev_tokens=torch.tensor([prompts[int(r)][-1] for r in step.request_ids]),
        is_first=torch.ones(len(step.request_ids), dtype=torch.bool),
        seeds=[0] * len(step.request_ids),
        embed=eng.runner.model.get_input_embeddings(),
    )
    with torch.inference_mode():  # as the runtime calls it
        destinations = routing.route(batch)
    assert destinations.shape == (len(prompts),) and set(destinations.tolist()) <= {0, 1}
    # The same decisions from the training features at each prompt's first position.
    data = swapped_data
    is_first = data.seq_position == torch.tensor([len(p) for p in prompts])[data.prompt_index]
    first = [int(torch.nonzero(is_first & (data.prompt_index == int(r)))) for r in step.request_ids]
    inputs = (data.hidden, data.token_embedding, data.top_logits)[: 3 if policy == "r2r" else 1]
    scores = torch.sigmoid(predict(module, inputs, torch.tensor(first)))
    assert torch.equal(routes(policy, scores, threshold).long(), destinations)


# -------------------------------------------------------------------------- verifier
def _data(**fields: list) -> RouterData:
    n = len(fields["small_token"])
    base = dict(
        prompt_index=[0] * n, seq_position=list(range(2, 2 + n)), large_logprob=[0.0] * n,
        small_logprob=[0.0] * n,
    )  # fmt: skip
    t = {k: torch.tensor(v) for k, v in {**base, **fields}.items()}
    return RouterData(
        hidden=torch.zeros(n, 4), token_embedding=torch.zeros(n, 4),
        top_logits=torch.zeros(n, 2), **t,
    )  # fmt: skip


def test_verifier_keeps_only_divergences_that_change_the_continuation() -> None:
    assert lcs_length([1, 2, 3, 4], [1, 3, 4, 5]) == 3
    sequence = [7, 7, 10, 11, 12, 13, 14, 15]  # prompt [7, 7], then the large model's tokens
    data = _data(small_token=[10, 20, 21, 0, 14, 15], large_token=sequence[2:])
    seen = []

    def continue_fn(prefixes: list[list[int]], steps: int) -> list[list[int]]:
        seen.extend(prefixes)
        # after the small token at 3 the large model recovers; after the one at 4 it does not
        return [[12, 13] if p[-1] == 20 else [99, 98] for p in prefixes]

    label = verify_divergences(continue_fn, [sequence], data, steps=2, eos_ids={0})
    assert seen == [[7, 7, 10, 20], [7, 7, 10, 11, 21]]  # prefix + small token, no EOS
    assert label.tolist() == [0, 0, 1, 1, 0, 0]  # recovered: 0; diverged or EOS: 1


# ------------------------------------------------------------------------- prompts, CLI
def test_chat_prompts_are_varied_and_use_the_chat_template() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    texts = chat_prompts(300, seed=1)
    assert len(texts) == 300 and len(set(texts)) == 300 and chat_prompts(300, seed=1) == texts
    words = sorted({w for t in texts for w in t.split()} | {"user", "assistant"})
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])
    plain = encode_prompts(fast, texts[:2])
    assert plain[0] == fast.encode(texts[0])
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    fast.chat_template += "{% if add_generation_prompt %}assistant{% endif %}"
    chat = encode_prompts(fast, texts[:2])
    assert chat[0] == fast.encode(f"user {texts[0]} assistant")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_missing_model_dir_is_a_clear_error(pair: dict, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    args = _parse(["train-router", "--policy", "r2r", "--small", missing, "--large",
                   pair["large"], "--out", str(tmp_path / "r.pt"), "--quiet"])  # fmt: skip
    with pytest.raises(UserFacingError, match=r"small model directory .*nope.* does not exist"):
        args.func(args)
    assert not (tmp_path / "r.pt").exists()


def test_cli_quick_run_with_a_tokenizer(pair: dict, tmp_path: Path, capsys) -> None:
    from tokenizers import Regex, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tok.pre_tokenizer = Split(Regex("."), behavior="isolated")  # one ASCII character per id
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?")
    assert fast.encode("Hi") == [ord("H"), ord("i")]
    fast.save_pretrained(pair["large"])  # no chat template: plain text
    out = tmp_path / "citer.pt"
    args = _parse(["train-router", "--policy", "citer", "--small", pair["swapped"], "--large",
                   pair["large"], "--out", str(out), "--quick", "--quiet", "--json"])  # fmt: skip
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["prompts"] == 24 and printed["max_tokens"] == 12
    assert load_router(out, "hidden_mlp")[1] == printed


def test_cli_help_defaults_match_the_library() -> None:
    assert commands.POLICIES == POLICIES
    defaults = TrainOptions()
    assert {k: getattr(defaults, k) for k in commands.DEFAULTS} == commands.DEFAULTS
    fields = set(TrainOptions.__dataclass_fields__)
    assert set(commands.OPTION_FLAGS) <= fields
