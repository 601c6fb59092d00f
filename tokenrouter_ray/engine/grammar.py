"""Structured outputs in the engine: a request's grammar, compiled per model, and one
xgrammar matcher per constrained request that follows the request's committed tokens.

A grammar enters as a ``GrammarSpec`` (kind + text) on the request's ``SamplingParams``;
it travels with them on a request's first visit to every model (``PeerReq.sampling``), so
every model that writes a token for the request masks its logits with the same grammar.

``GrammarBook`` is one model's side: a compiler over the model's tokenizer (its compiled
grammars kept, least recently used first out, by ``GrammarSpec``), and per request a
``GrammarState`` (held weakly by the engine's ``Request`` object: it goes when the request
does). Before a constrained row is sampled, ``GrammarBook.mask_rows``:

1. syncs the matcher to the request's committed output (``GrammarState.sync``): tokens it
   has not accepted yet are accepted (what this model sampled and committed last step, or
   the suffix a handoff brought); tokens it accepted that the request no longer has (a
   truncate at an anchor: another model replaced them) are rolled back, up to
   ``MAX_ROLLBACK`` tokens, else the matcher is reset and the kept prefix replayed;
2. fills one bitmask row per constrained row (one batched (rows, vocab/32) int32 tensor);
3. applies it to those rows' logits (``-inf`` for every forbidden token).

When the grammar is complete only the stop tokens (the model's EOS and the request's
``stop_token_ids``) stay allowed, so the request finishes with ``stop``. A committed token
the matcher refuses (only a bug could commit one) leaves only the stop tokens allowed too.

xgrammar is imported on first use only: nothing here costs anything until a request
carries a grammar.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenrouter_ray.engine.request import GrammarSpec, Request

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAX_ROLLBACK = 64  # tokens rolled back in place; a deeper truncate resets and replays
MAX_COMPILED = 64  # compiled grammars kept per model
# JSON is written compactly (", " and ": " between items, no other whitespace): free
# whitespace lets a small model wander into endless blank runs (a known failure of
# unconstrained whitespace), and the text means the same
JSON_SEPARATORS = (", ", ": ")


def grammar_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ log prefix (``[12:00:00] /x.cc:12: ``)."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text).strip() or type(exc).__name__


def check_grammar(spec: GrammarSpec) -> None:
    """Parse the grammar without a tokenizer (cheap); ``ValueError`` with xgrammar's reason
    when it is not one (a bad schema, regex or EBNF)."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.text, strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.text)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / pydantic errors
        raise ValueError(grammar_error(exc)) from None


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(
            spec.text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
        )
    if spec.kind == "json_object":
        import xgrammar as xgr

        grammar = xgr.Grammar.from_json_schema(
            '{"type": "object"}',
            any_whitespace=False,
            separators=JSON_SEPARATORS,
            strict_mode=False,
        )
        return compiler.compile_grammar(grammar)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.text)
    return compiler.compile_structural_tag(spec.text)


@dataclass(eq=False)
class GrammarState:
    """One request's matcher on one model and the output tokens it has accepted."""

    matcher: Any  # xgrammar.GrammarMatcher
    stop_token_ids: list[int] = field(default_factory=list)  # what ends it once complete
    accepted: list[int] = field(default_factory=list)
    broken: bool = False  # a committed token was refused: only stop tokens from here
    rollbacks: int = 0  # tokens rolled back in place (statistics, tests)
    replays: int = 0  # resets + replays (a truncate deeper than MAX_ROLLBACK)

    def sync(self, tokens: Sequence[int], start: int) -> None:
        """Make the matcher's accepted tokens equal ``tokens[start:]`` (the request's
        committed output): roll back what was dropped, accept what is new."""
        acc = self.accepted
        n = len(acc)
        if len(tokens) - start >= n and tokens[start : start + n] == acc:
            common = n
        else:
            output = tokens[start:]
            common = next(
                (i for i, (a, b) in enumerate(zip(acc, output, strict=False)) if a != b),
                min(n, len(output)),
            )
        if common < n:
            drop = n - common
            if drop <= MAX_ROLLBACK:
                self.matcher.rollback(drop)
                self.rollbacks += drop
            else:
                self.matcher.reset()
                self.replays += 1
                self.broken = not all(self.matcher.accept_token(t) for t in acc[:common])
            del acc[common:]
        for token in tokens[start + len(acc) :]:
            if self.broken or not self.matcher.accept_token(token):
                if not self.broken:
                    logger.warning("grammar: committed token %d refused by the matcher", token)
                self.broken = True
                break
            acc.append(token)

    @property
    def only_stop(self) -> bool:
        """Nothing but a stop token may follow (complete, terminated or broken)."""
        return self.broken or self.matcher.is_terminated()


class GrammarBook:
    """One model's compiled grammars and its constrained requests' matchers."""

    def __init__(self, tokenizer_info: Any, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.info = tokenizer_info
        self.vocab_size: int = tokenizer_info.vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1)
        self.compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self.states: weakref.WeakKeyDictionary[Request, GrammarState] = weakref.WeakKeyDictionary()
        self._bitmask: torch.Tensor | None = None  # (rows, ceil(vocab / 32)) int32, reused

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> GrammarBook:
        """From a Hugging Face tokenizer; ``vocab_size`` is the model's logits width (it may
        be larger than the tokenizer's vocabulary: the extra ids are never allowed)."""
        import xgrammar as xgr

        stops = sorted(set(stop_token_ids))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None
        )
        return cls(info, stops)

    @classmethod
    def for_model_dir(
        cls, path: str, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> GrammarBook:
        """From the tokenizer saved next to a model's weights."""
        from transformers import AutoTokenizer

        return cls.for_tokenizer(AutoTokenizer.from_pretrained(path), vocab_size, stop_token_ids)

    # ------------------------------------------------------------------- grammars
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (cached; least recently used evicted)."""
        compiled = self.compiled.get(spec)
        if compiled is None:
            compiled = self.compiled[spec] = _compile(self.compiler, spec)
            while len(self.compiled) > MAX_COMPILED:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(spec)
        return compiled

    def new_state(self, spec: GrammarSpec, stop_token_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher for ``spec``; the model's EOS and ``stop_token_ids`` end it."""
        import xgrammar as xgr

        stops = sorted(set(self.stop_token_ids) | set(stop_token_ids))
        matcher = xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=stops or None)
        return GrammarState(matcher, stop_token_ids=stops)

    def state(self, request: Request) -> GrammarState:
        """The request's matcher here, created on its first constrained row."""
        state = self.states.get(request)
        if state is None:
            sampling = request.sampling
            state = self.states[request] = self.new_state(sampling.grammar, sampling.stop_token_ids)
        return state

    # ---------------------------------------------------------------------- masks
    def mask_rows(
        self, logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int]
    ) -> None:
        """Sync every constrained row's matcher to its request's committed output, fill
        one bitmask for those rows and apply it to ``logits`` (num_rows, vocab) in place."""
        states = []
        for row in rows:
            request = requests[row]
            state = self.state(request)
            state.sync(request.token_ids, request.num_prompt_tokens)
            states.append((row, state))
        self.apply(logits, states)

    def apply(self, logits: torch.Tensor, states: Sequence[tuple[int, GrammarState]]) -> None:
        """Mask row ``row`` of ``logits`` (num_rows, vocab) with each synced ``state``: one
        host bitmask for every row (unconstrained rows allow everything), staged to the
        device once (pinned, non-blocking on CUDA) and applied in place: no device read
        and no synchronous copy, so it queues behind the forward."""
        import torch
        import xgrammar as xgr

        from tokenrouter_ray.engine.device_step import host_to_device

        num_rows, width = logits.shape
        bitmask = self._bitmask_for(num_rows)  # row i masks logits row i
        constrained = {row for row, _ in states}
        for row in range(num_rows):
            if row not in constrained:
                bitmask[row] = -1  # every bit set: all tokens allowed
        for row, state in states:
            if state.only_stop:
                _allow_only(bitmask, row, state.stop_token_ids, self.vocab_size)
            else:
                state.matcher.fill_next_token_bitmask(bitmask, row)
        if width > self.vocab_size:  # ids the tokenizer info does not cover: never allowed
            beyond = torch.zeros(num_rows, 1, dtype=torch.bool)  # (num_rows, 1) on the host
            beyond[sorted(constrained)] = True
            tail = logits[:, self.vocab_size :]  # (num_rows, width - vocab_size), a view
            tail.masked_fill_(host_to_device(beyond, logits.device), float("-inf"))
        mask = host_to_device(bitmask[:num_rows], logits.device)  # (num_rows, words) int32
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(width, self.vocab_size))

    def _bitmask_for(self, rows: int) -> torch.Tensor:
        import torch
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < rows:  # (rows, words) int32
            shape = xgr.get_bitmask_shape(max(rows, 8), self.vocab_size)
            self._bitmask = torch.full(shape, -1, dtype=torch.int32)  # all allowed
        return self._bitmask


def _allow_only(bitmask: torch.Tensor, row: int, tokens: Sequence[int], vocab_size: int) -> None:
    """Row ``row`` of an int32 bitmask allows ``tokens`` only (words built in Python: no
    read of the tensor)."""
    words: dict[int, int] = {}
    for token in tokens:
        if 0 <= token < vocab_size:
            word, bit = divmod(token, 32)
            words[word] = words.get(word, 0) | (1 << bit)
    bitmask[row] = 0
    for word, value in words.items():
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
