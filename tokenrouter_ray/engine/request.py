"""One request as one engine sees it: its tokens, its KV bookkeeping and its status.

Requests enter through ``Engine.add_request`` and leave when they reach a finished
status. A request owns its token list and its computed count, and changes them only
through its methods: ``append_tokens`` (sampled here or received from a peer model),
``truncate`` (tokens past an anchor that another model replaced), ``advance_computed``
(the runner computed KV for a chunk) and ``keep_computed`` (KV past a point was freed).
The scheduler moves requests between statuses; the KV cache manager owns ``block_ids``,
``block_hashes`` and ``num_hashed_blocks``.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

# kind -> what ``text`` holds
GRAMMAR_KINDS = {
    "json_schema": "a JSON schema (JSON text)",
    "json_object": "nothing (any JSON object)",
    "regex": "a regular expression",
    "ebnf": "an EBNF grammar (xgrammar / GBNF syntax, rule 'root')",
    "structural_tag": "an xgrammar structural tag (JSON text)",
}
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's text, in characters


class GrammarSpec(msgspec.Struct, array_like=True, frozen=True):
    """A request's grammar as it travels: ``kind`` (one of ``GRAMMAR_KINDS``) and its
    ``text``. Hashable: the compiled grammar is cached by it."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"grammar text is longer than {MAX_GRAMMAR_CHARS} characters")


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > PENDING`` means finished (one comparison)."""

    WAITING = 0  # has tokens without KV: a prefill, an extend after a handoff, a recompute
    RUNNING = 1  # in the running batch, decoding one token per step
    PENDING = 2  # handed to another model: out of the batch, KV and blocks kept
    FINISHED_STOPPED = 3  # EOS or a stop token
    FINISHED_LENGTH = 4  # max_tokens or the context limit
    FINISHED_ABORTED = 5  # client disconnect, error, or an explicit abort

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PENDING


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
SEED_BITS = 62  # a drawn seed is non-negative and fits every int64 on the way


def draw_seed() -> int:
    """The seed of a request that did not give one: drawn once, where it enters (the
    ingress, or ``Engine.add_request`` when an engine is used alone), then carried to every
    model it visits, so all of them sample and route it by the same stream."""
    return secrets.randbits(SEED_BITS)


MAX_CACHE_SALT = 256  # characters of a per-request cache_salt
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_REPETITION_PENALTY = 10.0  # a bound keeps x * p finite (and 0 * p not NaN)


class SamplingParams(msgspec.Struct, array_like=True, frozen=True):
    """Per-request sampling; ``temperature == 0`` is greedy.

    The one sampling type from the OpenAI layer to the sampler: the OpenAI layer builds it
    once (``SamplingOptions.spec``), it travels on a request's first visit to each model
    (``PeerReq.sampling``; the protocol calls it ``SamplingSpec``), and the engine samples
    and stops by it. Invalid values raise ``ValueError`` (on decode: ``ProtocolError``).
    Routing is not sampling: a request's routing inputs ride in ``RouteState``.

    ``cache_salt`` (vLLM's field, appended last too) keeps tenants' prefix caches apart:
    a request's KV blocks are only shared with requests carrying the same salt.

    Two optional reports per committed token, off by default (appended last, so older
    frames still decode): ``logprobs`` (None: none; k: the chosen token's log-probability
    and the k most likely tokens', from this model's raw logits) and ``trace`` (the
    router's score at each token and the proposals it dropped: the routing trace).

    Logits processors (vLLM's semantics; appended last too; ``engine/logits_processors.py``
    applies them, the same on every model, from the request's whole committed sequence):
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, on output tokens),
    ``repetition_penalty`` (on prompt and output tokens), ``logit_bias`` ((token id, bias)
    pairs, sorted by id), ``min_tokens`` (EOS and ``stop_token_ids`` cannot be sampled, and
    do not stop, until that many output tokens exist) and ``min_p`` (in the sampler's
    filters, after temperature).

    ``grammar`` (appended last): a structured-output grammar every model masks its logits
    with before sampling this request (engine/grammar.py); None: unconstrained.

    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_tokens: int = 16
    seed: int | None = None  # None: drawn once when the request is admitted
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to report per token (0..MAX_LOGPROBS)
    trace: bool = False  # report router scores and dropped proposals per token
    cache_salt: str | None = None  # prefix caching: only requests with equal salts share KV
    presence_penalty: float = 0.0  # -2..2: minus this for every token already in the output
    frequency_penalty: float = 0.0  # -2..2: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 0: tokens seen in prompt or output, / p if > 0 else * p
    min_p: float = 0.0  # 0..1: drop tokens below min_p x the top token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100), ids ascending
    min_tokens: int = 0  # EOS / stop_token_ids masked until this many output tokens exist
    grammar: GrammarSpec | None = None  # structured outputs: the tokens every model may write

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be 1..{MAX_CACHE_SALT} characters")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        ids = [t for t, _ in self.logit_bias]
        if any(t < 0 for t in ids) or ids != sorted(set(ids)):
            raise ValueError("logit_bias token ids must be >= 0, distinct and ascending")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        """Some logits processor changes this request's logits (``logits_processors.py``);
        False for the defaults, so a batch without any costs no extra work."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def reports_tokens(self) -> bool:
        """Per-token reports (logprobs or the routing trace) travel with its commits."""
        return self.trace or self.logprobs is not None


@dataclass(eq=False)
class Request:
    """Token ids plus how many of them already have KV in this engine's cache."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    num_prompt_tokens: int = -1  # output tokens are the ones after this many
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # its full blocks' chained hashes
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache (or tried)
    runnable_since: float = 0.0  # when it last became WAITING/RUNNING (deferred launch)
    num_preemptions: int = 0
    # prompt tokens its first computation here found in the prefix cache (-1: not yet)
    num_cached_tokens: int = -1
    seed: int = -1  # resolved seed: the given one, or drawn once at admission
    # only its KV is wanted (``Engine.prefill``): no token is sampled, and once every token
    # is computed it ends, its full blocks left in the prefix cache for a later request
    prefill_only: bool = False
    # sampling.has_processors, read once: the runner checks it per row per step
    uses_processors: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.uses_processors = self.sampling.has_processors
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        if self.seed < 0:
            self.seed = self.sampling.seed if self.sampling.seed is not None else draw_seed()
        self.runnable_since = self.arrival_time

    # ----------------------------------------------------------------- its tokens
    def append_tokens(self, token_ids: Sequence[int]) -> None:
        """Extend the sequence (a sampled token, or the suffix a peer model sent)."""
        self.token_ids.extend(token_ids)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (an anchor: what follows was replaced)."""
        del self.token_ids[num_tokens:]
        self.keep_computed(num_tokens)

    def advance_computed(self, num_tokens: int) -> None:
        """KV for the next ``num_tokens`` tokens was computed."""
        self.num_computed_tokens += num_tokens

    def keep_computed(self, num_tokens: int) -> None:
        """KV past the first ``num_tokens`` positions no longer counts (freed or stale)."""
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_runnable(self) -> bool:
        return self.status <= RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
