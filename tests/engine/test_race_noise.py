"""The sampler's noise is a counter-based stream of (seed, position): splitmix64
bit for bit, one row's the same alone or in any batch, Exp(1)-distributed, and drawn
without any ``torch.Generator``."""

from __future__ import annotations

import math

import pytest
import torch

from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.sampler import position_seed, race_noise, sample

MASK = (1 << 64) - 1


def splitmix_noise(key: int, j: int) -> float:
    """Token ``j``'s Exp(1) draw of the stream ``key``, in plain Python integers."""
    z = (key + (j + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    return -math.log(((z >> 12) + 0.5) / 2**52)


KEYS = [0, 1, 2**63 - 2, position_seed(1234, 17), position_seed(7, 0)]


def test_the_noise_is_splitmix64_of_the_key() -> None:
    vocab = 300
    got = race_noise(torch.tensor(KEYS), vocab)  # (5, 300) float32
    assert got.dtype == torch.float32 and got.shape == (len(KEYS), vocab)
    for i, key in enumerate(KEYS):
        want = torch.tensor([splitmix_noise(key, j) for j in range(vocab)]).float()
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=0.0)


def test_a_rows_noise_is_its_own_in_any_batch() -> None:
    vocab = 1000
    alone = [race_noise(torch.tensor([k]), vocab)[0] for k in KEYS]
    batch = race_noise(torch.tensor(KEYS), vocab)
    reversed_batch = race_noise(torch.tensor(KEYS[::-1]), vocab)
    for i in range(len(KEYS)):
        assert torch.equal(batch[i], alone[i])
        assert torch.equal(reversed_batch[len(KEYS) - 1 - i], alone[i])
    assert not torch.equal(alone[0], alone[1])


def test_the_noise_is_exp1_and_uncorrelated() -> None:
    """Mean and variance 1 (Exp(1)), never 0 or infinite, no correlation between
    neighbouring tokens or neighbouring positions of one seed."""
    keys = torch.tensor([position_seed(42, p) for p in range(64)])
    noise = race_noise(keys, 4096).double()  # (64, 4096): 262,144 draws
    n = noise.numel()
    assert bool(torch.isfinite(noise).all()) and float(noise.min()) > 0
    assert abs(float(noise.mean()) - 1) < 5 / math.sqrt(n)  # sd of the mean: 1 / sqrt(n)
    assert abs(float(noise.var()) - 1) < 5 * math.sqrt(8 / n)  # Exp(1)'s 4th central moment: 9
    u = torch.exp(-noise)  # back to uniforms: each decile holds a tenth
    deciles = torch.histc(u, bins=10, min=0, max=1) / n
    assert float((deciles - 0.1).abs().max()) < 5 * math.sqrt(0.09 / n)

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])

    assert abs(corr(noise[:, :-1], noise[:, 1:])) < 5 / math.sqrt(n)  # token j, j + 1
    assert abs(corr(noise[:-1], noise[1:])) < 5 / math.sqrt(n)  # position p, p + 1


def test_sampling_uses_no_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """No per-row ``torch.Generator`` and no ``exponential_``: a seeded batch samples with
    both gone, and a row's token does not depend on its neighbours."""

    def gone(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sampler made a generator or drew from one")

    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(3)) * 3
    monkeypatch.setattr(torch, "Generator", gone)
    monkeypatch.setattr(torch.Tensor, "exponential_", gone)
    params = [SamplingParams(temperature=t, top_p=0.9) for t in (0.7, 1.0, 1.3, 0.7, 1.0, 2.0)]
    seeds, positions = [11, 12, 13, 14, 15, 16], [5, 6, 7, 8, 9, 10]
    batch = sample(logits, params, seeds, positions)
    for i in range(6):
        alone = sample(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1], positions[i : i + 1])
        assert int(alone[0]) == int(batch[i])
    order = [5, 3, 1, 0, 2, 4]  # another batch composition: the same tokens, moved
    shuffled = sample(
        logits[order], [params[i] for i in order], [seeds[i] for i in order],
        [positions[i] for i in order],
    )  # fmt: skip
    assert shuffled.tolist() == [int(batch[i]) for i in order]


def test_filtered_tokens_are_never_drawn() -> None:
    """A token outside a row's top-k has probability 0, and ``0 / E`` never wins (E > 0)."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(4)).repeat(256, 1)
    params = [SamplingParams(temperature=5.0, top_k=3)] * 256
    tokens = sample(logits, params, [9] * 256, list(range(256)))  # one row, 256 positions
    assert set(tokens.tolist()) == set(torch.topk(logits[0], 3).indices.tolist())


def test_passes_do_not_change_the_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows drawn in bounded passes (two rows, one row, all at once) give the same noise."""
    from tokenrouter_ray.engine import sampler

    keys = torch.tensor(KEYS)
    whole = race_noise(keys, 700)
    for elements in (2 * 700, 1, 700 * 3 + 5):
        monkeypatch.setattr(sampler, "NOISE_CHUNK_ELEMENTS", elements)
        assert torch.equal(race_noise(keys, 700), whole)
