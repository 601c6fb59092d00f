"""Open-loop load: Poisson arrivals on top of the closed-system throughput model.

The Markov chain (``markov.py``) predicts ``T(n)``, the committed tokens per second with
``n`` requests active and the thresholds ``B(n)`` the scheduler applies at that ``n``. With
requests arriving as a Poisson stream of rate ``lambda`` (requests/s), each producing ``L``
output tokens, the number of active requests ``N(t)`` is modelled as a birth-death process:

* birth rate ``lambda`` in every state,
* death rate ``mu(n) = T(n) / L`` in state ``n`` (requests finish at the rate tokens are
  committed, divided by the tokens each request needs).

Its stationary distribution is ``pi(n) ∝ prod_{k=1..n} lambda / mu(k)``. That is exact for a
*fluid* model of the system: the ``n`` active requests share ``T(n)`` equally (each gets
``T(n) / n`` tokens/s), i.e. a processor-sharing queue whose total service rate depends on
the number present. Such a queue is *insensitive* (Kelly's symmetric queues): ``pi`` depends
on the work per request only through its mean, so fixed-length requests give the same ``pi``
as exponential ones. What the fluid model leaves out, and the measurement on the simulation
backend shows: the chain's transient after every change of ``n`` (it is assumed to be at its
stationary throughput ``T(n)`` at once), and the per-request randomness of routing.

Beyond the last state ``K`` with a computed ``T`` the tail rule extends ``mu``:

* ``"hold"``: ``mu(n) = mu(K)`` for ``n > K`` (the system saturates at ``T(K)``); stable iff
  ``lambda < mu(K)`` -- the stability limit. With a constant ``mu`` this is M/M/1.
* ``"linear"``: ``mu(n) = mu(K) n / K`` (every request keeps the per-request rate of state
  ``K``; with constant step times and batches of any size the Markov model's ``T(n)`` does
  grow linearly, see docs/user-guide/tuning.md); always stable. With ``mu(n) = n mu`` this is
  M/M/inf.
* ``"block"``: at most ``K`` requests; arrivals finding ``K`` are lost (an admission cap such
  as the ingress's ``max_active``). M/M/1/K with a constant ``mu``.

Predictions (``OpenLoopPrediction``): committed tokens/s ``sum_n pi(n) T(n)`` (``lambda L``
when nothing is lost), mean ``N``, mean latency by Little's law ``E[N] / lambda_served``, mean
time per output token ``E[latency] / L``.

**Time per output token (TPOT) and its p99.** The measured quantity is per request:
``(finish - arrival) / L``. Two predictions of its distribution:

1. ``tpot_quantile`` (analytic, *state-only*): a token committed in state ``n`` took its
   request ``n / T(n)`` seconds; weighting the states by the tokens served in them
   (``pi(n) T(n)``) gives a distribution over tokens whose mean equals the mean TPOT
   exactly (both are ``E[N] / (lambda L)``). Its quantiles describe how slow the *states*
   are, and ignore everything that varies within a state; they are a lower bound on the
   spread in practice.
2. ``simulate_processor_sharing`` (Monte Carlo of the fluid queue, request by request):
   Poisson arrivals, each request progresses at ``1 / D_r(n)`` of its work per second in
   state ``n``. Without routing noise ``D_r(n) = L n / T(n)``. With ``escalation=(q, a)``
   (two models, the entry model escalating a position with probability ``q``; ``a`` the
   time of a token that does not escalate, one small step) a request's ``K_r ~ Binomial(L,
   q)`` escalated tokens each cost an extra ``e(n) = (n / T(n) - a) / q``:
   ``D_r(n) = L a + K_r e(n)``, whose mean over ``K_r`` is ``L n / T(n)`` again. This keeps
   the state dynamics of (1) and adds the dominant within-state effect: in the paper setting
   at L = 32 routing alone spreads a request's TPOT by about 17 % (standard deviation), far
   more than the states do (``T(n) / n`` lies within 45.7..63.4 tok/s for every ``n``).
   The escalation cost ``e(n)`` is its mean at ``n``; the spread of batch-fill waits is not
   modelled.

Both are approximations and are labelled as such wherever they are printed; the open-loop
validation (``simulation/validate.py``, ``loadtest/markov_open_loop.py``) puts them next to
the measured p99.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.profile import RoutingProfile

TAILS = ("hold", "linear", "block")


def _tail_rate(rates: np.ndarray, n: int, tail: str) -> float:
    """``mu(n)`` (or ``T(n)``) for any ``n >= 1`` from the computed ``rates[1..K]``."""
    k = len(rates) - 1
    if n <= k:
        return float(rates[n])
    if tail == "linear":
        return float(rates[k]) * n / k
    return float(rates[k])  # hold (block never asks past K)


def _padded(rates: Sequence[float]) -> np.ndarray:
    values = np.asarray([float(r) for r in rates], dtype=float)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError("need the service rate of at least one state (n = 1)")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"service rates must be positive and finite, got {values.tolist()}")
    return np.concatenate([[0.0], values])


def stability_limit(service_rates: Sequence[float], tail: str = "hold") -> float:
    """The largest arrival rate with a stationary distribution (requests/s): ``mu(K)`` for
    ``"hold"``, infinite for ``"linear"`` and ``"block"``."""
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    rates = _padded(service_rates)
    return float(rates[-1]) if tail == "hold" else math.inf


def birth_death_stationary(
    arrival_rate: float,
    service_rates: Sequence[float],
    tail: str = "hold",
    tol: float = 1e-13,
    max_states: int = 2_000_000,
) -> tuple[np.ndarray, float]:
    """``pi(n)`` for ``n = 0..len - 1`` of the birth-death chain with birth rate
    ``arrival_rate`` and death rates ``service_rates[n - 1]`` (``n = 1..K``), extended past
    ``K`` by ``tail``. States are added until the mass left out is below ``tol`` (relative);
    returns ``(pi, mass left out)``. An unstable chain (``"hold"`` with ``lambda >= mu(K)``)
    is a ``ValueError``."""
    if not arrival_rate > 0 or not math.isfinite(arrival_rate):
        raise ValueError(f"arrival rate must be positive and finite, got {arrival_rate}")
    limit = stability_limit(service_rates, tail)
    if arrival_rate >= limit:
        raise ValueError(
            f"unstable: arrival rate {arrival_rate:g}/s >= the stability limit {limit:g}/s "
            f"(service rate of the last state, tail {tail!r})"
        )
    rates = _padded(service_rates)
    k = len(rates) - 1
    log_w = [0.0]  # log of the unnormalised pi, pi(0) = 1
    top, total = 0.0, 1.0  # running max of log_w and sum of exp(log_w - top)
    n = 0
    while not (tail == "block" and n == k):
        value = log_w[-1] + math.log(arrival_rate / _tail_rate(rates, n + 1, tail))
        log_w.append(value)
        if value > top:
            total, top = total * math.exp(top - value) + 1.0, value
        else:
            total += math.exp(value - top)
        n += 1
        if n >= k and tail != "block":
            # past K the ratios lambda / mu(n) are constant ("hold") or fall ("linear"), so
            # the rest of the tail is below a geometric series with the next ratio
            ratio = arrival_rate / _tail_rate(rates, n + 1, tail)
            if ratio < 1 and math.exp(value - top) * ratio / (1 - ratio) <= tol * total:
                break
        if n >= max_states:
            raise ValueError(f"the distribution needs more than {max_states} states")
    weights = np.asarray(log_w)
    pi = np.exp(weights - weights.max())
    total = pi.sum()
    left_out = 0.0
    if tail != "block":
        ratio = arrival_rate / _tail_rate(rates, n + 1, tail)
        left_out = float(pi[-1] * ratio / (1 - ratio) / total)
    return pi / total, left_out


@dataclass(frozen=True)
class OpenLoopPrediction:
    """The birth-death model of one open-loop load (see the module docstring)."""

    arrival_rate: float  # lambda, requests/s
    tokens_per_request: float  # L
    token_rate: np.ndarray  # T(n), tokens/s, n = 0..len(pi) - 1 (T(0) = 0)
    pi: np.ndarray  # P(N = n)
    tail: str
    stability_limit: float  # requests/s (inf: stable at any rate)
    left_out: float  # probability mass past the last state kept

    @property
    def states(self) -> np.ndarray:
        return np.arange(len(self.pi))

    @property
    def throughput(self) -> float:
        """Committed tokens/s, ``sum_n pi(n) T(n)``."""
        return float(self.pi @ self.token_rate)

    @property
    def served_rate(self) -> float:
        """Requests finished per second (``lambda`` unless arrivals are blocked)."""
        return self.throughput / self.tokens_per_request

    @property
    def blocking(self) -> float:
        """Fraction of arrivals lost at the cap (``"block"`` only)."""
        return float(self.pi[-1]) if self.tail == "block" else 0.0

    @property
    def mean_active(self) -> float:
        return float(self.pi @ self.states)

    @property
    def mean_latency_s(self) -> float:
        """Mean time in system of a served request (Little's law)."""
        return self.mean_active / self.served_rate

    @property
    def mean_tpot_s(self) -> float:
        """Mean time per output token of a request, ``E[latency] / L``."""
        return self.mean_latency_s / self.tokens_per_request

    @property
    def busy_fraction(self) -> float:
        """``1 - pi(0)``: the fraction of time some request is active."""
        return 1.0 - float(self.pi[0])

    @property
    def load(self) -> float:
        """``lambda`` over the stability limit (0 when the limit is infinite)."""
        return self.arrival_rate / self.stability_limit

    def tpot_quantile(self, q: float) -> float:
        """The state-only TPOT quantile: ``n / T(n)`` over states weighted by the tokens
        served in them, ``pi(n) T(n)`` (seconds per token)."""
        if not 0 < q < 1:
            raise ValueError(f"quantile must be in (0, 1), got {q}")
        n = self.states[1:]
        per_token = n / self.token_rate[1:]
        weight = self.pi[1:] * self.token_rate[1:]
        order = np.argsort(per_token, kind="stable")
        cumulative = np.cumsum(weight[order]) / weight.sum()
        index = int(np.searchsorted(cumulative, q - 1e-12))
        return float(per_token[order][min(index, len(order) - 1)])


def predict_open_loop(
    arrival_rate: float,
    tokens_per_request: float,
    token_rates: Sequence[float],
    tail: str = "hold",
    tol: float = 1e-13,
) -> OpenLoopPrediction:
    """The birth-death prediction from ``token_rates[n - 1] = T(n)`` (tokens/s, ``n =
    1..K``), with ``mu(n) = T(n) / L``."""
    if not tokens_per_request > 0:
        raise ValueError(f"tokens per request must be positive, got {tokens_per_request}")
    rates = _padded(token_rates)
    service = rates[1:] / tokens_per_request
    pi, left_out = birth_death_stationary(arrival_rate, service, tail, tol)
    token_rate = np.asarray([0.0] + [_tail_rate(rates, n, tail) for n in range(1, len(pi))])
    return OpenLoopPrediction(
        arrival_rate=float(arrival_rate),
        tokens_per_request=float(tokens_per_request),
        token_rate=token_rate,
        pi=pi,
        tail=tail,
        stability_limit=stability_limit(service, tail),
        left_out=left_out,
    )


def markov_token_rates(
    profile: RoutingProfile,
    tables: Sequence[ThresholdTable | Sequence[int]],
    max_n: int,
) -> np.ndarray:
    """``T(n)`` for ``n = 1..max_n`` from the exact chain, with each model's threshold read
    from its table at ``n`` (the lookup rule the scheduler applies)."""
    if len(tables) != profile.num_models:
        raise ValueError(f"need one threshold table per model ({profile.num_models})")
    parsed = [ThresholdTable.of(t) for t in tables]
    return np.asarray(
        [
            throughput(profile, n, tuple(t.at(n) for t in parsed)).throughput
            for n in range(1, max_n + 1)
        ]
    )


# ------------------------------------------------------------------- processor sharing
@dataclass(frozen=True)
class SojournSample:
    """Per-request times of a simulated processor-sharing run (after warm-up)."""

    sojourn_s: np.ndarray
    tokens_per_request: int
    mean_active: float  # time-average number in system over the measured span

    @property
    def tpot_s(self) -> np.ndarray:
        return self.sojourn_s / self.tokens_per_request

    def tpot_quantile(self, q: float) -> float:
        return float(np.quantile(self.tpot_s, q))


def simulate_processor_sharing(
    arrival_rate: float,
    tokens_per_request: int,
    token_rates: Sequence[float],
    tail: str = "hold",
    requests: int = 20_000,
    warmup: int = 1_000,
    seed: int = 0,
    escalation: tuple[float, float] | None = None,
) -> SojournSample:
    """Monte Carlo of the fluid queue: Poisson arrivals, ``n`` requests present share
    ``T(n)`` (``token_rates[n - 1]``, extended by ``tail``); a request needs ``L`` tokens.

    ``escalation=(q, a)`` adds routing noise (module docstring): request r draws ``K_r ~
    Binomial(L, q)`` and its whole work takes ``D_r(n) = L a + K_r e(n)`` seconds in state
    ``n``, ``e(n) = max(0, n / T(n) - a) / q``. Returns the sojourn times of requests
    ``warmup..requests - 1`` (by arrival order)."""
    if tail == "block":
        raise ValueError("the processor-sharing simulation has no admission cap")
    rates = _padded(token_rates)
    most = stability_limit(rates[1:], tail)  # tokens/s the queue can serve at most
    if arrival_rate * tokens_per_request >= most:
        raise ValueError(f"unstable: {arrival_rate:g} requests/s of {tokens_per_request} "
                         f"tokens against at most {most:g} tokens/s")  # fmt: skip
    if not 0 <= warmup < requests:
        raise ValueError(f"need 0 <= warmup < requests, got {warmup}, {requests}")
    length = int(tokens_per_request)
    rng = random.Random(seed)
    cache: dict[int, tuple[float, float]] = {}  # n -> (a, e(n))
    q, a = escalation if escalation is not None else (0.0, 0.0)
    if escalation is not None and not (0 < q <= 1 and a >= 0):
        raise ValueError(f"escalation must be (q in (0, 1], a >= 0), got {escalation}")

    def costs(n: int) -> tuple[float, float]:
        """(per-token base, extra per escalated token) in state n."""
        if n not in cache:
            per_token = n / _tail_rate(rates, n, tail)
            if escalation is None:
                cache[n] = (per_token, 0.0)
            else:
                base = min(a, per_token)
                cache[n] = (base, (per_token - base) / q)
        return cache[n]

    remaining = np.zeros(0)  # fraction of its work left, per request present
    escalated = np.zeros(0)  # K_r
    index = np.zeros(0, dtype=np.int64)  # arrival number
    arrived_at = np.zeros(requests)
    sojourn = np.full(requests, np.nan)
    now, next_arrival, arrivals = 0.0, rng.expovariate(arrival_rate), 0
    area, span_start, span_end = 0.0, None, None
    while arrivals < requests or len(remaining):
        n = len(remaining)
        if n:
            base, extra = costs(n)
            duration = length * base + escalated * extra  # D_r(n)
            to_finish = remaining * duration
            first = int(np.argmin(to_finish))
            dt_done = float(to_finish[first])
        else:
            dt_done = math.inf
        dt_arrival = next_arrival - now if arrivals < requests else math.inf
        dt = min(dt_done, dt_arrival)
        if span_start is not None and span_end is None:
            area += n * dt
        now += dt
        if n:
            remaining = remaining - dt / duration
        if dt_arrival <= dt_done:
            if arrivals == warmup:
                span_start = now
            k = sum(rng.random() < q for _ in range(length)) if escalation else 0
            remaining = np.append(remaining, 1.0)
            escalated = np.append(escalated, float(k))
            index = np.append(index, arrivals)
            arrived_at[arrivals] = now
            arrivals += 1
            if arrivals < requests:
                next_arrival = now + rng.expovariate(arrival_rate)
            elif span_end is None:
                span_end = now
        else:
            done = remaining <= 1e-12
            done[first] = True
            for r in index[done]:
                sojourn[r] = now - arrived_at[r]
            keep = ~done
            remaining, escalated, index = remaining[keep], escalated[keep], index[keep]
    span = (span_end - span_start) if span_start is not None and span_end else 0.0
    return SojournSample(
        sojourn_s=sojourn[warmup:],
        tokens_per_request=length,
        mean_active=area / span if span > 0 else float("nan"),
    )
