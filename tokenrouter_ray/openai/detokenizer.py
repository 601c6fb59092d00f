"""Incremental detokenization of one output sequence, with stop strings.

Committed token ids enter through `push` (any number at a time, in order); text that is safe
to show leaves as its return value, and `finish` returns the rest once the output has ended.
One `IncrementalDetokenizer` per choice (a request with ``n=2`` has two).

Three things make a token's text not yet safe to show:

- Neighbours change it. Byte-level BPE splits a multi-byte character over tokens, and
  SentencePiece decoders drop or keep a leading space depending on what came before. So
  each token is decoded inside a window of earlier tokens: the new text is
  ``decode(ids[prefix:]) - decode(ids[prefix:read])`` (vLLM's ``prefix_offset /
  read_offset``), which makes the concatenation of everything emitted equal to
  ``decode(all_ids)``.
- It ends in an incomplete character (U+FFFD): held back until the character completes, and
  only flushed by `finish` if it never does.
- It could be the start of a stop string: the longest suffix that is a prefix of some stop
  string is held back, so no part of a stop string is ever emitted. When a stop string
  appears, the output is cut before it, `stopped` becomes true, `stop_reason` is that string,
  and further pushes return ``""`` (the caller aborts the request).

Special tokens (EOS, ...) decode to nothing with ``skip_special_tokens=True`` (vLLM's
default; a request may turn it off).

vLLM's output options (given per request):

- ``include_stop_str_in_output``: the output is cut after the stop string instead of
  before it (streaming still holds a possible prefix back until it is decided).
- ``stop_token_ids`` (the request's stop tokens and EOS): a token that ends the output has no
  text in it unless ``include_stop_str_in_output``. Such a token's text is held back when it
  arrives; if more tokens follow (it did not end the output) it is emitted before them,
  and `finish` drops it otherwise.
- ``min_tokens``: stop strings completed by one of the first ``min_tokens`` output tokens
  do not stop (the engine masks EOS and stop tokens for those tokens: the same count).

Per-token reports (logprobs, the routing trace) need to know which tokens a piece of text
belongs to: `token_ends[i]` is where output token i's text ends in the decoded output (set
once its text is decoded), and `settled()` counts the tokens whose text has been emitted
in full (every consumed token once the output stopped or finished).
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Callable, Collection, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_WINDOW = 5  # prompt tokens decoded with the first output token (vLLM uses 5 too)


def plain_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=...)`` as a one-argument call. For a fast
    tokenizer whose decode adds nothing to its Rust decoder's (no clean-up of tokenization
    spaces), that decoder is called directly: transformers' wrapper costs about as much
    again as the decoding, twice per streamed token (docs/benchmarks/README.md)."""
    backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's tokenizers.Tokenizer
    cleans = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    if backend is None or cleans or not callable(getattr(backend, "decode", None)):
        return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Token ids in, safe-to-show text out, for one sequence."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        stop: Sequence[str] = (),
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        stop_token_ids: Collection[int] = (),
        min_tokens: int = 0,
    ) -> None:
        """``prompt_token_ids``: the prompt (only its last few ids are kept) so the first
        output token decodes as a continuation; None decodes the output on its own."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = plain_decoder(tokenizer, skip_special_tokens)
        self.include_stop = include_stop_str_in_output
        self.stop_token_ids = frozenset(stop_token_ids)
        self.min_tokens = min_tokens
        self._held_token: int | None = None  # a stop token that may end the output
        self.stop = tuple(s for s in stop if s)
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        context = list(prompt_token_ids[-CONTEXT_WINDOW:]) if prompt_token_ids else []
        self._ids: list[int] = context  # context + output ids
        self._prefix = 0  # window start: decoded only for context
        self._read = len(context)  # ids before this have been turned into text
        self._prefix_text = self._decode(self._prefix, self._read)
        self._held = ""  # decoded but not emitted: could be the start of a stop string
        self._pieces: list[str] = []
        self.num_tokens = 0  # output tokens consumed, up to the one that completed a stop
        self.stopped = False
        self.stop_reason: str | None = None
        self.finished = False
        self.token_ends: list[int] = []  # end of each output token's text, once decoded
        self._decoded_len = 0  # length of the decoded output (stop strings not cut)
        self._emitted_len = 0

    def settled(self) -> int:
        """Output tokens whose text has been emitted in full (all of them, once the output
        stopped or finished): the ones a streamed chunk can report."""
        if self.stopped or self.finished:
            return self.num_tokens
        return bisect_right(self.token_ends, self._emitted_len)

    @property
    def text(self) -> str:
        """Everything emitted so far (for non-streaming responses)."""
        return "".join(self._pieces)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add output token ids; return the text that became safe to emit (maybe ``""``)."""
        if self.stopped or self.finished:
            return ""
        emitted: list[str] = []
        for token_id in token_ids:
            if self._held_token is not None:  # more came: it did not end the output
                emitted.append(self._take(self._held_token, self.num_tokens))
                self._held_token = None
                if self.stopped:
                    break
            self.num_tokens += 1
            if (
                int(token_id) in self.stop_token_ids
                and not self.include_stop
                and self.num_tokens > self.min_tokens
            ):
                self._held_token = int(token_id)
                continue
            emitted.append(self._take(int(token_id), self.num_tokens))
            if self.stopped:
                break
        return self._emit("".join(emitted))

    def _take(self, token_id: int, position: int) -> str:
        """Decode output token number ``position`` and filter stop strings."""
        self._ids.append(token_id)
        new_text = self._advance(final=False)
        if not new_text:
            return ""
        return self._filter_stop(new_text, final=False, check=position > self.min_tokens)

    def finish(self) -> str:
        """The output ended: return whatever was held back (stop-string prefixes, an
        incomplete character). Idempotent; ``""`` after a stop string."""
        if self.stopped or self.finished:
            return ""
        self.finished = True
        # A held stop token ended the output: counted, its text left out.
        self._held_token = None
        text = self._emit(self._filter_stop(self._advance(final=True), final=True))
        missing = self.num_tokens - len(self.token_ends)  # e.g. a trailing special token
        self.token_ends += [self._decoded_len] * missing
        return text

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
            self._emitted_len += len(text)
        return text

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._decode_ids(self._ids[start:end])

    def _advance(self, final: bool) -> str:
        """Text the ids after ``_read`` add to the window; ``""`` (offsets kept) while it is
        empty or ends in an incomplete character, unless ``final``."""
        full_text = self._decode(self._prefix, len(self._ids))
        if len(full_text) <= len(self._prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        new_text = full_text[len(self._prefix_text) :]
        self._decoded_len += len(new_text)
        self.token_ends += [self._decoded_len] * (len(self._ids) - self._read)
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        return new_text

    def _filter_stop(self, new_text: str, final: bool, check: bool = True) -> str:
        """Cut at the first stop string (before it, or after it with
        ``include_stop_str_in_output``; not when ``check`` is false: before min_tokens);
        hold back a suffix that could start one."""
        text = self._held + new_text
        self._held = ""
        if not self.stop:
            return text
        cut, reason = -1, None
        for s in self.stop if check else ():
            i = text.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, reason = i, s
        if reason is not None:
            self.stopped, self.stop_reason = True, reason
            return text[: cut + len(reason)] if self.include_stop else text[:cut]
        if not final:
            keep = self._stop_prefix_len(text)
            if keep:
                self._held = text[-keep:]
                return text[:-keep]
        return text

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_held), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
