"""The routing-policy interface: written from one request's point of view, run batched.

After every step of model ``i`` the runtime hands the policy a ``RouteBatch`` (the step's
sampled tokens, logits and last hidden states as device tensors, one row per request) and
asks three things:

- ``route(batch)``: the destination model index of every row, computed on device for the
  whole batch at once; only this index vector leaves the device. A policy that computes a
  scalar score per row on the way (a router probability, an entropy) stores it in
  ``batch.scores`` (higher: closer to escalating; NaN for rows it did not score); the
  runtime copies it to the host only for steps where some request asked for a routing
  trace. docs/user-guide/policies.md says what each policy's score is.
  A policy compares its score with ``batch.thresholds(configured)``: per row, the
  request's own threshold (the API's ``routing`` field, ``RouteState.thresholds``) or the
  configured one; just the configured float when no row overrides it.
  A policy whose decision needs no tensor at all (a seeded draw, a fixed destination, the
  large model of an escalate-once policy) may also answer ``route_host(batch)`` with the
  same destinations as a host list; the runtime's step then touches no device for routing.
  An ``EscalateOnce`` policy implements the same two shapes one level down: ``escalate``
  (+ optional ``escalate_host``) says which rows of model 0 the large model takes.
- ``send(request, dst)``: for a row leaving model ``i``, what travels: whether the sampled
  token is dropped (the destination regenerates that position) and policy extras.
- ``receive(request, tokens, extras)``: on arrival at the destination, which of the
  committed tokens it takes (default: all of them).

Models are indexed from the smallest/entry model (0) upwards. A policy is configured by a
pydantic model and registered by name (``register_policy``), one policy per file.

Callers never call ``route`` / ``route_host`` themselves: ``decide(policy, batch)`` picks
the host path or the device path (without autograd, on the masked or raw logits as
``routes_on_masked_logits`` says) for the replica's step, the sequential reference and the
tests alike.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from tokenrouter_ray.engine.outputs import StepResult

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are made, not at import time: the runtime imports this
# interface and stays torch-free until a step runs (tests/test_layering.py).


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _OnStepDevice:
    """A per-row field of ``RouteBatch`` given as a tensor or as a host sequence; a host
    sequence becomes a tensor on the step's device the first time a policy reads it, so a
    policy that never reads the field costs no copy (dataclass field with a descriptor
    default: ``__init__`` goes through ``__set__``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            raise AttributeError(self.name)  # no default: the field is required
        value = obj.__dict__[self.name]
        if not hasattr(value, "device"):  # a host sequence: move it once
            import torch

            value = obj.__dict__[self.name] = torch.tensor(
                list(value), device=obj.step.sampled.device
            )
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


@dataclass
class RouteBatch:
    """What ``route`` sees: the step output plus per-row facts, all batched."""

    model: int  # index of the model that ran this step
    step: StepResult  # sampled (B,), logits (B, V), hidden (B, H) on device
    # (B,) long: logical position of each sampled token; (B,) long: the token before it;
    # (B,) bool: first output token of the request (host lists move on first read)
    positions: torch.Tensor = _OnStepDevice()  # type: ignore[assignment]
    prev_tokens: torch.Tensor = _OnStepDevice()  # type: ignore[assignment]
    is_first: torch.Tensor = _OnStepDevice()  # type: ignore[assignment]
    seeds: Sequence[int] = ()  # per-request seeds (for seeded random policies)
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # token ids -> embeddings
    # (B,) float, set by ``route`` when the policy computes a score per row (NaN: none for
    # that row); None: no score at this model (fixed and random policies, R2R's large model)
    scores: torch.Tensor | None = None
    # (B,) float: each row's request's own decision threshold at this model (NaN: the
    # policy's configured one), a host list until ``thresholds`` first reads it; None: no
    # row overrides (the fast path: no tensor at all). Read through ``thresholds``.
    threshold_overrides: Sequence[float] | torch.Tensor | None = None

    @classmethod
    def of_step(
        cls,
        model: int,
        step: StepResult,
        prev_tokens: Sequence[int],
        is_first: Sequence[bool],
        seeds: Sequence[int],
        embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
        threshold_overrides: Sequence[float] | None = None,
    ) -> RouteBatch:
        """The batch for one step of model ``model``: per-row facts come in as host lists
        (one per row of ``step``) and reach the step's device only if the policy reads
        them, so the runtime that calls this needs no torch. ``threshold_overrides``:
        ``threshold_overrides(...)`` of the rows' requests (None: no row overrides)."""
        return cls(
            model=model,
            step=step,
            positions=step.positions,
            prev_tokens=prev_tokens,
            is_first=is_first,
            seeds=seeds,
            embed=embed,
            threshold_overrides=threshold_overrides,
        )

    def thresholds(self, default: float, dtype: torch.dtype | None = None) -> torch.Tensor | float:
        """Each row's decision threshold: its request's override, else ``default`` (the
        configured one), as a (B,) tensor on the step's device in ``dtype`` (the score's:
        an override compares as the configured float does against that score). When no
        row overrides, ``default`` itself: no tensor, no copy, the policy's old path."""
        overrides = self.threshold_overrides
        if overrides is None:
            return default
        import torch

        if not hasattr(overrides, "device"):  # a host list: move it once, in float64
            overrides = self.threshold_overrides = torch.tensor(
                list(overrides), dtype=torch.float64, device=self.device
            )
        chosen = torch.where(overrides.isnan(), default, overrides)  # (B,)
        return chosen if dtype is None else chosen.to(dtype)

    def host_thresholds(self, default: float) -> Sequence[float] | float:
        """``thresholds`` on the host, for a policy's ``route_host``: a list, or ``default``
        when no row overrides."""
        overrides = self.threshold_overrides
        if overrides is None:
            return default
        values = overrides.tolist() if hasattr(overrides, "device") else overrides
        return [default if t != t else t for t in values]  # NaN: the configured one

    @property
    def host_positions(self) -> Sequence[int]:
        """``positions`` on the host, without a device round trip when it came from there."""
        value = self.__dict__["_positions"]
        return value.tolist() if hasattr(value, "device") else value

    @property
    def size(self) -> int:
        return len(self.step.request_ids)

    @property
    def device(self) -> torch.device:
        return self.step.sampled.device


@dataclass
class RequestView:
    """One request as the policy sees it in ``send``/``receive``."""

    request_id: str
    model: int  # where it is now
    position: int  # logical position of the token just sampled (send) / next to fill
    state: dict[str, Any] = field(default_factory=dict)  # policy scratch, per request


@dataclass(frozen=True)
class Send:
    drop_sampled: bool  # the destination regenerates the position just sampled
    extras: dict[str, Any] = field(default_factory=dict)


class Policy(ABC):
    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]] = PolicyConfig
    needs_logits: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False
    needs_embeddings: ClassVar[bool] = False
    needs_tokenizer: ClassVar[bool] = False  # built with the models' (shared) tokenizer
    # Structured outputs: route on the logits the row was sampled from (the grammar's mask
    # applied: a forced token is certain) or on the model's raw logits (what a router trained
    # on unconstrained text saw). docs/user-guide/policies.md says which policy reads which and why.
    routes_on_masked_logits: ClassVar[bool] = True
    min_models: ClassVar[int] = 2
    max_models: ClassVar[int | None] = 2

    def __init__(self, config: PolicyConfig, models: Sequence[str], tokenizer: Any = None) -> None:
        if len(models) < self.min_models or (self.max_models and len(models) > self.max_models):
            most = self.max_models or "any number of"
            raise ValueError(
                f"policy {self.name!r} routes between {self.min_models}..{most} models, "
                f"got {len(models)}: {list(models)}"
            )
        self.config = config
        self.models = list(models)
        self.tokenizer = tokenizer

    @property
    def threshold_levels(self) -> int:
        """How many decision thresholds a request may set (``routing.threshold``): 1 for
        most, 0 for a policy without one, one per level for escalation (declared in
        routing/__init__.py ``THRESHOLDS``, which the ingress reads too)."""
        from tokenrouter_ray.routing import threshold_levels

        return threshold_levels(self.name, len(self.models))

    @abstractmethod
    def route(self, batch: RouteBatch) -> torch.Tensor:
        """(B,) long destination model index per row, on ``batch.device``."""

    def route_host(self, batch: RouteBatch) -> list[int] | None:
        """The destinations of ``route``, computed on the host, for a policy whose decision
        needs no tensor; None (the default): route on the device. Must equal
        ``route(batch).tolist()`` row for row (tests/routing/test_route_host.py)."""
        return None

    def send(self, request: RequestView, dst: int) -> Send:
        """Default: escalating to a larger model drops the token it will regenerate;
        returning to a smaller one keeps the token just generated."""
        return Send(drop_sampled=dst > request.model)

    def receive(self, request: RequestView, tokens: list[int], extras: dict[str, Any]) -> list[int]:
        """Default: take every token the peer committed."""
        return tokens


class EscalateOnce(Policy):
    """The shape of R2R, CITER, Co-LLM and their baselines: model 0 generates; where
    ``escalate`` says so its token is dropped and model 1 generates exactly that one token,
    then control returns to model 0."""

    @abstractmethod
    def escalate(self, batch: RouteBatch) -> torch.Tensor:
        """(B,) bool: should the large model produce this position instead?"""

    def escalate_host(self, batch: RouteBatch) -> list[bool] | None:
        """``escalate`` on the host, for a policy that needs no tensor; None: no host path."""
        return None

    def route(self, batch: RouteBatch) -> torch.Tensor:
        if batch.model != 0:
            import torch

            return torch.zeros(batch.size, dtype=torch.long, device=batch.device)
        return self.escalate(batch).long()

    def route_host(self, batch: RouteBatch) -> list[int] | None:
        if type(self).route is not EscalateOnce.route:  # a subclass routes its own way
            return None
        if batch.model != 0:  # the large model always returns control
            return [0] * batch.size
        escalate = self.escalate_host(batch)
        return None if escalate is None else [int(e) for e in escalate]


def decide(policy: Policy, batch: RouteBatch, host: bool = True) -> list[int]:
    """Every row's destination model index, on the host: the policy's ``route_host`` when
    it has one (and ``host``), else its ``route`` without autograd on the step as it reads
    it: where some row was constrained by a grammar, ``step.logits`` are the masked logits
    if ``routes_on_masked_logits``, else the raw ones (as without a grammar). Only the
    index vector leaves the device; the scores ``route`` computed land on ``batch`` and
    stay there (``host_scores``). ``host=False``: the device path even where a host path
    exists (the sequential reference, and the test that the two agree)."""
    if host:
        found = policy.route_host(batch)
        if found is not None:
            return found
    import torch

    step = batch.step
    with torch.inference_mode():
        if not policy.routes_on_masked_logits or step.masked_logits is None:
            return policy.route(batch).tolist()
        view = replace(batch, step=replace(step, logits=step.masked_logits))
        destinations = policy.route(view).tolist()
        batch.scores = view.scores
        return destinations


def row_threshold(thresholds: Sequence[float], model: int) -> float:
    """A request's own threshold at model ``model`` from its ``RouteState.thresholds``:
    one value applies at every model, k values are per level (escalation's ``tau_l``; the
    top level, which decides nothing, gets the last); NaN when it gives none."""
    if not thresholds:
        return math.nan
    return float(thresholds[min(model, len(thresholds) - 1)])


def threshold_overrides(thresholds: Sequence[Sequence[float]], model: int) -> list[float] | None:
    """``RouteBatch.threshold_overrides`` for rows whose requests carry these
    ``thresholds`` (in row order) at model ``model``; None when none overrides."""
    if not any(thresholds):
        return None
    return [row_threshold(t, model) for t in thresholds]


def capped_dst(
    dst: int, here: int, top: int, top_tokens: int, committed: int, cap: float | None
) -> int:
    """Where a row goes under a request's cap on the top model's share of its output
    (``routing.max_large_share``), given the policy's choice ``dst`` at model ``here`` for
    the token at output position ``committed`` (``top_tokens`` of the ``committed`` tokens
    before it came from the top model).

    The top model writes a token only while its share, that token counted, stays at or
    under the cap: a move up to the top is refused (the row stays ``here``) unless
    ``top_tokens + 1 <= cap * (committed + 1)``; at the top, staying (committing this token
    and writing the next) needs ``top_tokens + 2 <= cap * (committed + 2)``, else the row
    goes one model down. Every other decision is the policy's. Only the top model's share
    is capped (in a chain of three, moves between the lower models are never refused), so
    the share at every point of the output, and at its end, is at most the cap."""
    if cap is None or dst != top or top == 0:
        return dst
    if here != top:
        return dst if top_tokens + 1 <= cap * (committed + 1) + 1e-9 else here
    return dst if top_tokens + 2 <= cap * (committed + 2) + 1e-9 else here - 1


def host_scores(batch: RouteBatch) -> list[float | None] | None:
    """``batch.scores`` on the host, NaN as None; None when the policy left none."""
    if batch.scores is None:
        return None
    return [None if s != s else s for s in batch.scores.tolist()]


def normalized_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) / log(V) per row: 0 for a certain model, 1 for a uniform one.
    Tokens a grammar masked (``-inf``) have probability 0 and add nothing."""
    logp = logits.double().log_softmax(dim=-1)  # (B, V)
    terms = (logp.exp() * logp).nan_to_num(nan=0.0)  # masked: 0 * -inf is 0, not NaN
    return -terms.sum(-1) / math.log(logits.shape[-1])


# --------------------------------------------------------------------------- registry
POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def policy_class(name: str) -> type[Policy]:
    """The registered policy class called ``name`` (built-in policies load on first use)."""
    from tokenrouter_ray.routing import load_builtin_policies

    load_builtin_policies()
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]


def build_policy(
    name: str, options: dict[str, Any] | None, models: Sequence[str], tokenizer: Any = None
) -> Policy:
    """Build a policy; pass ``tokenizer`` when ``policy_class(name).needs_tokenizer``."""
    cls = policy_class(name)
    return cls(cls.Config(**(options or {})), models, tokenizer)
