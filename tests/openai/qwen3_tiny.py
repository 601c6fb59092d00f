"""A tiny Qwen3 stand-in for the reasoning and tool tests: Qwen3's chat template (written
for these tests from Qwen3's published template: tools, tool calls and results, thinking,
``enable_thinking``), a byte-level tokenizer with Qwen3's added tokens (``<|im_start|>``,
``<think>``, ``<tool_call>``, ...), a random-weight Qwen3 model of the tiny shape (``save_qwen3``; a
set of them, one per served model: ``save_qwen3_models``), and a
scripted core for the served app (the app's routes, parsers and SSE are what is tested
there; a random-weight model never writes a tool call by itself).

`ScriptedCore` answers each request with the token ids of ``script(prompt_text)``, a few
tokens per step (as a model committing several tokens per step would), and records the
prompt and sampling of every request it was sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tokenrouter_ray.ingress.core import RequestResult
from tokenrouter_ray.protocol import CommitLog, MsgKind, PeerReq, encode_batch

TEMPLATE = (Path(__file__).parent / "qwen3_template.jinja").read_text()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
VOCAB_SIZE = 272  # 256 byte tokens + 9 added, rounded up


def qwen3_tokenizer() -> Any:
    """Byte-level (one token per byte, no merges) with Qwen3's special and added tokens;
    ``<|im_end|>`` is EOS, as in Qwen3's instruct models."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    return fast


def save_qwen3(path: Path, seed: int, generation: dict[str, Any] | None = None) -> str:
    """A random-weight tiny Qwen3 with the tokenizer (and ``generation_config.json``)."""
    import json

    from tests.tiny_models import save_tiny

    tokenizer = qwen3_tokenizer()
    save_tiny(
        path,
        "qwen3",
        seed,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.4,
    )
    tokenizer.save_pretrained(path)
    if generation is not None:
        config = {"eos_token_id": tokenizer.eos_token_id, **generation}
        (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


def save_qwen3_models(root: Path, names: list[str]) -> dict[str, str]:
    """One tiny Qwen3 per name under ``root`` (seeds 3, 4, ... in the order given): the
    models the structured-output and tool tests hand requests between."""
    return {name: save_qwen3(root / name, seed) for seed, name in enumerate(names, start=3)}


class ScriptedCore:
    """What the routes use of `IngressCore`, answering with scripted text."""

    def __init__(
        self, tokenizer: Any, script: Callable[[str], str], tokens_per_step: int = 3
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.per_step = tokens_per_step
        self.live: dict[str, tuple[list[int], Any, list[int]]] = {}
        self.sent: list[tuple[str, list[int], Any]] = []  # (rid, prompt, sampling)

    @property
    def num_active(self) -> int:
        return len(self.live)

    async def submit(self, rid: str, prompt: list[int], spec: Any, entry: str, **_: Any) -> None:
        new = PeerReq(rid, "ingress", entry, MsgKind.NEW, 0, tokens=list(prompt), sampling=spec)
        encode_batch([new])  # what the real core sends must encode
        text = self.script(self.tokenizer.decode(prompt))
        out = list(self.tokenizer.encode(text, add_special_tokens=False))
        self.live[rid] = (prompt, spec, out[: spec.max_tokens])
        self.sent.append((rid, list(prompt), spec))

    async def stream(self, rid: str, each_chunk: bool = True) -> AsyncIterator[list[int]]:
        out = self.live[rid][2]
        if not each_chunk:  # the real core's: everything at the end, as one list
            yield list(out)
            return
        for i in range(0, len(out), self.per_step):
            yield out[i : i + self.per_step]

    def abort_nowait(self, rid: str, reason: str | None = None) -> None:
        pass

    def commit_log(self, rid: str) -> CommitLog:
        return CommitLog(len(self.live[rid][0]))

    def release(self, rid: str) -> RequestResult:
        prompt, spec, out = self.live.pop(rid)
        full = len(self.tokenizer.encode(self.script(self.tokenizer.decode(prompt))))
        reason = "length" if full > spec.max_tokens else "stop"
        done = RequestResult(rid, len(prompt), finish_reason=reason, counts={"small": len(out)})
        done.token_ids = list(out)
        return done
