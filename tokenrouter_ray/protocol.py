"""The peer protocol: the `PeerReq` message, its codec, and the rules a receiver applies.

Owns what travels between the ingress and the model replicas and the few rules that make it
correct without a global barrier (docs/design/architecture.md, "The request lifecycle"):

- `PeerReq` is the only message type. It leaves a process as bytes from `encode` /
  `encode_batch` (msgpack, positional; `by_destination` groups a step's messages into
  one frame per destination) and enters one through `decode` / `decode_batch`;
  a frame that is not a valid PeerReq of this protocol version raises `ProtocolError`.
  Runtime state is typed: `RouteState` rides on NEW and HANDOFF (where the request's
  output goes, every model's anchor and replica, the counts so far), `FinishSummary` on the
  FINISHED sent to the ingress; `extras` belongs to the routing policy alone.
- `RequestLedger` is kept by each receiver. `accept(msg)` says whether to act on a message:
  only a `handoff_seq` newer than the one held counts, and nothing revives a finished request.
- `Anchors` is kept per request by its current owner: for every model, how many of the
  request's tokens that model holds in its KV, hence which suffix to send it.
- `CommitLog` is kept per request by the ingress: committed output assembled by logical
  position, so commits from different models that arrive out of order are not lost.
- `check_shared_tokenizer` runs at start-up: token ids travel, so all models must agree on them.

Nothing here imports Ray, ZeroMQ or torch (`engine.request`, for the sampling type, is
torch-free).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Any

import msgspec

from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.errors import UserFacingError

PROTOCOL_VERSION = 4
"""Wire version of `PeerReq`, sent as the first element of every encoded message.

Messages are positional arrays. An optional field may be appended at the end of `PeerReq`
or `SamplingSpec` without a version bump (older receivers ignore trailing elements); any
other change (removing, reordering, retyping a field) bumps the version, and a receiver
rejects versions it does not speak with `ProtocolError`.

v2: typed `RouteState` and `FinishSummary` instead of string keys in `extras`.
v3: `MsgKind.ACTIVE` (an ingress's active-request count); `active_requests` optional.
v4: a request's own routing thresholds ride in `RouteState.thresholds`, not in `SamplingSpec`.
Optional fields appended since v3, without a bump (a peer without them ignores them, so a
deployment must not mix builds while requests use them): per-token reports and per-request
metrics, the sampling penalties, `logit_bias` and `min_tokens`, `MsgKind.DRAIN`,
`RouteState.alone` and `.max_share`.
"""

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol (undecodable, wrong version, inconsistent)."""


class TokenizerMismatchError(UserFacingError, ValueError):
    """Two models of one deployment do not share a tokenizer."""


class MsgKind(IntEnum):
    """What a `PeerReq` asks of its receiver. FINISHED and ABORT are terminal."""

    NEW = 0  # first visit: create request state, prefill `tokens` (the whole prompt)
    HANDOFF = 1  # control passes to the receiver; `tokens` extends what it already holds
    COMMIT = 2  # report of committed output (to the ingress)
    FINISHED = 3  # the request ended (EOS, stop, max_tokens): free its state
    ABORT = 4  # the client went away: free its state
    ACTIVE = 5  # from an ingress to every model replica: its `active_requests` (no request)
    PREFILL = 6  # from an ingress at admission: compute the KV of `tokens` (the prompt) and
    # keep it in the prefix cache for the request's first handoff here; no state, no answer
    DRAIN = 7  # from a model replica that is leaving (scale-down) to an ingress: stop placing
    # requests on `src`, re-create the ones that may be there elsewhere (no request)

    @property
    def is_terminal(self) -> bool:
        return self is MsgKind.FINISHED or self is MsgKind.ABORT


SamplingSpec = SamplingParams
"""Sampling parameters, sent once, with a request's first visit to a model: the engine's
own `SamplingParams` (one type, one set of defaults, end to end)."""


class Dropped(msgspec.Struct, array_like=True, frozen=True):
    """A token a model sampled and the policy dropped (``Send.drop_sampled``): another
    model regenerates that position. Reported only for requests with a routing trace."""

    model: str  # the proposer
    token: int
    score: float | None = None  # the router's score that dropped it


class TokenInfo(msgspec.Struct, array_like=True, frozen=True):
    """What a COMMIT reports about one committed token, for requests that asked
    (``SamplingSpec.trace`` / ``.logprobs``)."""

    score: float | None = None  # the router's score at this token (trace)
    logprob: float | None = None  # of this token under the writer's raw logits
    top_ids: list[int] = []  # the writer's most likely tokens here, descending
    top_logprobs: list[float] = []
    dropped: list[Dropped] = []  # proposals dropped at this position before this token


class RouteState(msgspec.Struct, array_like=True, frozen=True):
    """A request's routing state, sent by its owner with every HANDOFF (and by the ingress
    with a NEW): the next owner adopts it whole.

    On a NEW, `anchors` is empty (every model starts afresh) and `counts` / `prompt_len`
    describe what a re-created request already committed (its NEW carries prompt +
    committed output, of which the first `prompt_len` tokens are the prompt).
    """

    ingress: str  # endpoint that receives COMMIT / FINISHED
    prompt_len: NonNegative
    anchors: dict[str, NonNegative] = {}  # model -> tokens of the sequence it holds in KV
    endpoints: dict[str, str] = {}  # model -> endpoint of the replica holding it
    counts: dict[str, NonNegative] = {}  # model -> committed output tokens
    handoffs: NonNegative = 0
    deadline: float | None = None  # wall clock (time.time()) past which nobody waits
    # per-request metrics, accumulated by each owner in turn (wall-clock seconds)
    queue_s: float | None = None  # ingress send -> first step computing it at the entry
    pending_s: dict[str, float] = {}  # model -> time it held KV while another owned it
    pending_since: dict[str, float] = {}  # model -> time.time() it last went pending
    peer_bytes: NonNegative = 0  # encoded size of every HANDOFF sent so far (this one too)
    dropped: NonNegative = 0  # sampled tokens dropped at handoffs
    drops: list[Dropped] = []  # dropped at the next position to fill (traced requests)
    cached_tokens: NonNegative | None = None  # prompt tokens the entry found in its cache
    alone: str | None = None  # the model serving it alone: no policy, no handoffs (bypass)
    max_share: float | None = None  # cap on the top model's share of the output (capped_dst)
    # the request's own decision threshold(s) (the API's `routing`), each in [0, 1]; empty:
    # the policy's configured one; one: at every model; k: one per escalation level
    # (routing/policy.py `row_threshold`)
    thresholds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if any(not 0 <= t <= 1 for t in self.thresholds):  # NaN fails too
            raise ValueError(f"route thresholds must be in [0, 1], got {self.thresholds}")


class FinishSummary(msgspec.Struct, array_like=True, frozen=True):
    """What the FINISHED sent to the ingress reports about the whole request."""

    counts: dict[str, NonNegative] = {}  # model -> committed output tokens
    handoffs: NonNegative = 0
    error: str | None = None  # set when a model ended the request with an error
    queue_s: float | None = None
    pending_s: dict[str, float] = {}  # every model's, open intervals closed at the end
    peer_bytes: NonNegative = 0
    dropped: NonNegative = 0
    cached_tokens: NonNegative | None = None  # prompt tokens the entry found in its cache
    # the model endpoint a HANDOFF could not reach when that ended the request (``error``
    # set): the ingress re-creates the request instead if the endpoint has left
    lost_peer: str | None = None


class PeerReq(msgspec.Struct, array_like=True, frozen=True, tag=PROTOCOL_VERSION):
    """One message between the ingress and the replicas, about one request.

    `tokens` is the suffix the receiver has not seen; it starts at logical position `anchor`
    of the request's sequence (prompt + output). Its first `committed` tokens are committed
    output. `handoff_seq` grows with every message its current owner sends for the request.
    `dst` / `src` are endpoint names (`endpoint_name(model, replica)` in the transport).
    `route` is the request's routing state (NEW, HANDOFF), `summary` the finish summary
    (FINISHED to the ingress); `extras` are the routing policy's own (``Send.extras``).
    `active_requests` is set by an ingress only (on NEW and ACTIVE): how many requests it
    holds right now, 0 included. Each model keeps the latest count per ingress endpoint
    (`src`) and uses their sum as the global N of its launch thresholds.
    `sent_at` is `time.time_ns()` when the message was built: a wall clock, so one-way
    latency can be measured across processes and (clock sync permitting) across nodes.
    `token_info` rides on COMMITs of requests that asked for logprobs or a routing trace:
    empty, or one `TokenInfo` per committed token.
    """

    rid: str
    src: str
    dst: str
    kind: MsgKind
    handoff_seq: NonNegative
    tokens: list[int] = []
    anchor: NonNegative = 0
    committed: NonNegative = 0
    finish_reason: str | None = None
    sampling: SamplingSpec | None = None
    route: RouteState | None = None
    summary: FinishSummary | None = None
    extras: dict[str, Any] = {}
    active_requests: NonNegative | None = None
    sent_at: int = msgspec.field(default_factory=time.time_ns)
    token_info: list[TokenInfo] = []  # COMMIT: one per committed token, if the request asked

    def __post_init__(self) -> None:
        if self.committed > len(self.tokens):
            raise ValueError(
                f"PeerReq {self.rid}: committed={self.committed} exceeds "
                f"len(tokens)={len(self.tokens)}"
            )
        if self.token_info and len(self.token_info) != self.committed:
            raise ValueError(
                f"PeerReq {self.rid}: {len(self.token_info)} token_info entries for "
                f"{self.committed} committed tokens"
            )

    @property
    def end(self) -> int:
        """Logical position just past `tokens`."""
        return self.anchor + len(self.tokens)

    @property
    def committed_tokens(self) -> list[int]:
        return self.tokens[: self.committed]


# One encoder and decoders created once: msgspec reuses their buffers and type plans.
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerReq)
_batch_decoder = msgspec.msgpack.Decoder(list[PeerReq])


def encode(msg: PeerReq) -> bytes:
    return _encoder.encode(msg)


def _uint_size(value: int) -> int:
    """Bytes msgpack spends on a non-negative integer."""
    return 1 if value < 128 else 2 if value < 256 else 3 if value < 65536 else (
        5 if value < 1 << 32 else 9
    )  # fmt: skip


def with_own_size(msg: PeerReq) -> PeerReq:
    """``msg`` (carrying a ``route``) with its own encoded size added to
    ``route.peer_bytes``: one encode; the count's own width is solved for, so the result
    is exact (``len(encode(result))`` is what was added)."""
    assert msg.route is not None
    before = msg.route.peer_bytes
    encoded = len(_encoder.encode(msg))
    size = encoded
    while True:  # the count is one msgpack uint inside the message: only its width moves
        grown = encoded - _uint_size(before) + _uint_size(before + size)
        if grown == size:
            break
        size = grown
    route = msgspec.structs.replace(msg.route, peer_bytes=before + size)
    return msgspec.structs.replace(msg, route=route)


def decode(data: bytes | bytearray | memoryview) -> PeerReq:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ProtocolError(
            f"bad PeerReq frame (this build speaks v{PROTOCOL_VERSION}): {exc}"
        ) from exc


def by_destination(msgs: Iterable[PeerReq]) -> dict[str, list[PeerReq]]:
    """``msgs`` grouped by ``dst``, one list (one frame's worth) per destination; the
    destinations in the order they first appear, each list in the order given."""
    groups: dict[str, list[PeerReq]] = {}
    for msg in msgs:
        groups.setdefault(msg.dst, []).append(msg)
    return groups


def encode_batch(msgs: Sequence[PeerReq]) -> bytes:
    """Several messages for one destination, leaving in one step, as one frame."""
    return _encoder.encode(msgs)


def decode_batch(data: bytes | bytearray | memoryview) -> list[PeerReq]:
    try:
        return _batch_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            f"bad PeerReq batch (this build speaks v{PROTOCOL_VERSION}): {exc}"
        ) from exc


class RequestLedger:
    """A receiver's memory of which messages it has acted on, per request id.

    Rules (docs/design/architecture.md, "The request lifecycle"), all in `accept`:
    - a message is acted on only if its `handoff_seq` is newer than the highest one held for
      its rid: duplicates, stale and reordered older messages are ignored;
    - FINISHED / ABORT are accepted once per rid, whatever their `handoff_seq` (a terminal
      message can come from the ingress, which does not know the newest seq, and nothing
      follows it anyway); after that nothing about the rid is accepted again.

    Memory: live rids are held until their terminal message (or `forget`). Finished rids are
    remembered in an LRU of at most `finished_capacity` entries, refreshed on every hit, so a
    zombie message for a rid evicted long ago could be accepted again; size the capacity well
    above requests finished per "maximum network delay" (the default, 2**16, is generous).

    Commits reach the ingress from several models over different connections and may be
    reordered across senders; the ingress orders them by position with `CommitLog`, not by
    dropping them here.
    """

    def __init__(self, finished_capacity: int = 1 << 16) -> None:
        if finished_capacity < 1:
            raise ValueError("finished_capacity must be >= 1")
        self.finished_capacity = finished_capacity
        self._held: dict[str, int] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()

    def accept(self, msg: PeerReq) -> bool:
        rid = msg.rid
        if rid in self._finished:
            self._finished.move_to_end(rid)
            return False
        if msg.kind.is_terminal:
            self._held.pop(rid, None)
            self._remember_finished(rid)
            return True
        if msg.handoff_seq <= self._held.get(rid, -1):
            return False
        self._held[rid] = msg.handoff_seq
        return True

    def finish(self, rid: str) -> None:
        """Mark a rid finished locally (e.g. its owner stopped it): nothing revives it."""
        self._held.pop(rid, None)
        self._remember_finished(rid)

    def held_seq(self, rid: str) -> int | None:
        """Highest `handoff_seq` acted on for a live rid; None if unknown or finished."""
        return self._held.get(rid)

    def is_finished(self, rid: str) -> bool:
        return rid in self._finished

    def forget(self, rid: str) -> None:
        """Drop a live rid without finishing it (e.g. its state was freed for another reason)."""
        self._held.pop(rid, None)

    @property
    def num_live(self) -> int:
        return len(self._held)

    def _remember_finished(self, rid: str) -> None:
        self._finished[rid] = None
        if len(self._finished) > self.finished_capacity:
            self._finished.popitem(last=False)


class Anchors:
    """For one request: model name -> how many of the request's tokens that model holds in KV.

    The anchor is the logical position of the first token the model has *not* seen, so the
    suffix to send it is `sequence[anchor:]`: the whole prompt on a first visit, only the
    new tokens afterwards. `advance` moves an anchor forward as a model takes tokens in;
    `rewind` moves it back when tokens it holds were dropped (e.g. R2R drops the small
    model's token at the routed position).
    """

    __slots__ = ("_pos",)

    def __init__(self, positions: Mapping[str, int] | None = None) -> None:
        self._pos: dict[str, int] = dict(positions or {})

    def get(self, model: str) -> int:
        return self._pos.get(model, 0)

    def visited(self, model: str) -> bool:
        return model in self._pos

    def suffix_for(self, model: str, sequence: Sequence[int]) -> tuple[int, list[int]]:
        """(anchor, sequence[anchor:]) for `model`."""
        anchor = self._pos.get(model, 0)
        if anchor > len(sequence):
            raise ValueError(
                f"anchor of {model!r} is {anchor}, past the sequence end {len(sequence)}: "
                "rewind it when tokens it holds are dropped"
            )
        return anchor, list(sequence[anchor:])

    def advance(self, model: str, pos: int) -> None:
        current = self._pos.get(model, 0)
        if pos < current:
            raise ValueError(f"advance({model!r}, {pos}) would move back from {current}")
        self._pos[model] = pos

    def rewind(self, model: str, pos: int) -> None:
        current = self._pos.get(model, 0)
        if not 0 <= pos <= current:
            raise ValueError(f"rewind({model!r}, {pos}) must be within [0, {current}]")
        self._pos[model] = pos

    def as_dict(self) -> dict[str, int]:
        return dict(self._pos)

    def __repr__(self) -> str:
        return f"Anchors({self._pos!r})"


class CommitLog:
    """The ingress's committed output for one request, assembled by logical position.

    `add(anchor, tokens, writer, infos)` takes committed tokens starting at `anchor` (from
    `writer`, with one `TokenInfo` each when the request asked for them) and returns the
    tokens that became contiguous (ready to stream). Duplicates and overlaps are absorbed;
    a commit past the current end waits until the gap is filled. Committed tokens are
    final, so an overlap that disagrees with what is held raises `ProtocolError`.
    `writers[i]` / `infos[i]` belong to `tokens[i]` (`infos` stays empty until some commit
    carries them, then is padded with None where one did not).
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self.tokens: list[int] = []
        self.writers: list[str | None] = []
        self.infos: list[TokenInfo | None] = []
        self._pending: dict[int, tuple[list[int], str | None, Sequence[TokenInfo] | None]] = {}

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    def add(
        self,
        anchor: int,
        tokens: Sequence[int],
        writer: str | None = None,
        infos: Sequence[TokenInfo] | None = None,
    ) -> list[int]:
        if anchor < self.start:
            raise ProtocolError(f"commit at {anchor} lies inside the prompt (ends at {self.start})")
        if anchor > self.end:
            held = self._pending.get(anchor)
            if held is None or len(held[0]) < len(tokens):
                self._pending[anchor] = (list(tokens), writer, infos)
            return []
        fresh = self._append(anchor, tokens, writer, infos)
        while self._pending:
            ready = [a for a in self._pending if a <= self.end]
            if not ready:
                break
            for a in sorted(ready):
                fresh += self._append(a, *self._pending.pop(a))
        return fresh

    def settled(self) -> CommitLog:
        """A copy holding only the contiguous output (commits waiting on a gap dropped)."""
        log = CommitLog(self.start)
        log.tokens, log.writers, log.infos = list(self.tokens), list(self.writers), list(self.infos)
        return log

    def _append(
        self,
        anchor: int,
        tokens: Sequence[int],
        writer: str | None,
        infos: Sequence[TokenInfo] | None,
    ) -> list[int]:
        overlap = self.end - anchor
        held = self.tokens[anchor - self.start :]
        if list(tokens[:overlap]) != held[: len(tokens)]:
            raise ProtocolError(
                f"commit at {anchor} rewrites committed output ({list(tokens[:overlap])} vs "
                f"{held[: len(tokens)]})"
            )
        fresh = list(tokens[overlap:])
        if infos or self.infos:
            self.infos += [None] * (len(self.tokens) - len(self.infos))
            self.infos += list(infos[overlap:]) if infos else [None] * len(fresh)
        self.tokens += fresh
        self.writers += [writer] * len(fresh)
        return fresh


@dataclass(frozen=True)
class TokenizerFingerprint:
    """What must agree between two tokenizers for token ids to mean the same thing."""

    vocab_size: int
    vocab_sha256: str
    special_ids: tuple[tuple[str, int | None], ...]

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerFingerprint:
        """Works for transformers tokenizers and raw `tokenizers.Tokenizer` objects."""
        vocab: dict[str, int] = tokenizer.get_vocab()
        if hasattr(tokenizer, "__len__"):
            size = len(tokenizer)
        elif hasattr(tokenizer, "get_vocab_size"):
            size = tokenizer.get_vocab_size()
        else:
            size = len(vocab)
        digest = hashlib.sha256(msgspec.msgpack.encode(sorted(vocab.items()))).hexdigest()
        names = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
        special = tuple((name, getattr(tokenizer, name, None)) for name in names)
        return cls(vocab_size=size, vocab_sha256=digest, special_ids=special)

    def differences(self, other: TokenizerFingerprint) -> list[str]:
        diffs = []
        if self.vocab_size != other.vocab_size:
            diffs.append(f"vocab size {self.vocab_size} vs {other.vocab_size}")
        if self.vocab_sha256 != other.vocab_sha256:
            diffs.append("token -> id mappings differ")
        for (name, mine), (_, theirs) in zip(self.special_ids, other.special_ids, strict=True):
            if mine != theirs:
                diffs.append(f"{name} {mine} vs {theirs}")
        return diffs


def check_shared_tokenizer(tokenizers: Mapping[str, Any]) -> None:
    """Raise `TokenizerMismatchError` (a ValueError) naming two models whose tokenizers differ.

    `tokenizers` maps model name -> tokenizer. Every model is compared with the first one.
    """
    items = [(name, TokenizerFingerprint.of(tok)) for name, tok in tokenizers.items()]
    if len(items) < 2:
        return
    first_name, first = items[0]
    for name, fingerprint in items[1:]:
        diffs = first.differences(fingerprint)
        if diffs:
            raise TokenizerMismatchError(
                f"models {first_name!r} and {name!r} do not share a tokenizer "
                f"({'; '.join(diffs)}). Token ids travel between models, so every model "
                "in a deployment must use the same tokenizer."
            )
