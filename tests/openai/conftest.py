"""Tokenizers for the OpenAI-layer tests.

`demo_tokenizer`: the real SmolLM2-135M-Instruct tokenizer (byte-level BPE with a chat
template), from the demo directory that ``prepare-demo`` built once. `sp_tokenizer`: a tiny
SentencePiece-style tokenizer (metaspace, byte fallback, leading-space strip) trained in
memory, for the neighbour-dependent decoding that byte-level BPE does not exercise.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tokenrouter_ray.demo.large import prepare_demo

    return AutoTokenizer.from_pretrained(prepare_demo(quiet=True))


@pytest.fixture(scope="session")
def sp_tokenizer() -> Any:
    """Llama-style: ``▁`` for spaces, ``<0xNN>`` byte fallback for unknown characters, and a
    decoder that strips the first leading space of whatever it decodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    chars = list("▁abcdefghijklmnopqrstuvwxyz,.!?'éïç東京")
    merges = [
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("l", "l"),
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
        ("▁", "a"),
        ("i", "n"),
        ("in", "g"),
        ("▁", "▁"),
        ("ll", "o"),
    ]
    vocab = {t: i for i, t in enumerate(specials + byte_tokens + chars)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
