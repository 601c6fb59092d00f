"""The deferred-batching Markov chain: reachable states and the sparse transition matrix.

Closed system of N requests over M models. A state is observed right after an event has
been handled (routing done, launches done) and holds, per model i, ``(k_i, b_i, r_i)``:
waiting requests, running batch size, grains left of the running batch (``b_i = r_i = 0``
when idle); and, per *transit pair* (i, j) (a move i -> j with ``p_ij > 0`` that spends
``d_ij > 0`` grains between the models), ``(f_ij, e_ij)``: requests in flight from i to j and
grains until they land (``0, 0`` when none). Each transition out of a state is one event:

1. the running batch(es) with the smallest ``r`` and the groups in flight with the smallest
   ``e`` are due; ``tau`` = that many grains pass and every other ``r`` and ``e`` drops by
   ``tau``. Ties happen together;
2. the groups due land: ``f_ij`` requests become *waiting* at j;
3. each of the ``b_i`` requests of a finishing model i moves to model j with probability
   ``p_ij`` (independently: a multinomial per finishing model) and commits ``c_ij`` tokens;
   it arrives as *waiting* at j (a request routed i -> i waits at i like any other), or, for
   a transit pair, takes off: ``f_ij`` of them land together ``d_ij`` grains later;
4. every idle model j with ``k_j >= B_j`` launches a batch of all its waiting requests
   (at most ``max_batch_j`` when the profile sets one), lasting ``grains[j, b]``.

One group in flight per pair is exact as long as ``d_ij`` is at most model i's shortest step
(i cannot finish again before its last group landed); longer transits are refused here (the
Monte Carlo model, ``montecarlo.py``, takes any). Without transit pairs the state and the
chain are exactly those of the transit-free model.

Enumeration is a breadth-first search from the start state (all N requests waiting at model
0, then launches), vectorized over the whole frontier with numpy: a state is packed into one
int64 key (mixed radix), the arrival distribution of each (finishing set, batch sizes) pair is
computed once and cached, and new states are found by sorted-array membership. The result is
a ``Chain`` with a CSR transition matrix, the expected tokens committed by each state's event
(``reward``) and its duration (``tau``, grains).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.special import gammaln

INT64_LIMIT = 2**62


class ChainTooLarge(ValueError):
    """The chain has more reachable states than the caller allowed (``max_states``)."""


@dataclass(frozen=True)
class ChainInputs:
    """The numbers a chain is built from (all arrays indexed by model)."""

    n_requests: int
    thresholds: np.ndarray  # (M,) B_i
    grains: np.ndarray  # (M, N + 1) step length in grains per batch size
    max_batch: np.ndarray  # (M,) largest batch a launch takes
    route_prob: np.ndarray  # (M, M) p_ij
    tokens_per_request: np.ndarray  # (M,) sum_j p_ij c_ij
    transit: np.ndarray | None = None  # (M, M) grains between models per move; None: 0

    @property
    def num_models(self) -> int:
        return int(self.thresholds.shape[0])

    def transit_pairs(self) -> list[tuple[int, int]]:
        """The moves i -> j (i != j, p_ij > 0) that spend at least a grain in flight."""
        if self.transit is None:
            return []
        m = self.num_models
        return [
            (i, j)
            for i in range(m)
            for j in range(m)
            if i != j and self.transit[i, j] > 0 and self.route_prob[i, j] > 0
        ]

    def transit_fits(self) -> bool:
        """One group in flight per pair is exact: every transit no longer than its sender's
        shortest step."""
        return all(self.transit[i, j] <= self.grains[i, 1:].min() for i, j in self.transit_pairs())

    def check_transit(self) -> None:
        """``ValueError`` unless ``transit_fits``."""
        for i, j in self.transit_pairs():
            shortest = int(self.grains[i, 1:].min())
            if self.transit[i, j] > shortest:
                raise ValueError(
                    f"transit {i}->{j} of {int(self.transit[i, j])} grains is longer than "
                    f"model {i}'s shortest step ({shortest} grains): the exact chain holds one "
                    "group in flight per pair; use the Monte Carlo method"
                )


@dataclass(frozen=True)
class Chain:
    """A built chain; states are rows of ``fields`` in discovery order (start state first)."""

    fields: np.ndarray  # (S, 3M + 2P) int: k_0, b_0, r_0, k_1, ..., then f, e per transit pair
    transition: sp.csr_matrix  # (S, S) row-stochastic
    reward: np.ndarray  # (S,) expected tokens committed by the state's event
    tau: np.ndarray  # (S,) grains until the next batch completion

    @property
    def num_states(self) -> int:
        return int(self.fields.shape[0])

    @property
    def num_transitions(self) -> int:
        return int(self.transition.nnz)


class _Codec:
    """Packs per-model (k, b, r) rows, then per transit pair (f, e), into int64 keys with a
    mixed radix."""

    def __init__(self, n_requests: int, max_grains: np.ndarray, transits: list[int]) -> None:
        radices = []
        for g in max_grains.tolist():
            radices += [n_requests + 1, n_requests + 1, int(g) + 1]
        for d in transits:
            radices += [n_requests + 1, int(d) + 1]
        weights = np.cumprod([1, *radices[:-1]]).astype(object)
        if int(weights[-1]) * radices[-1] >= INT64_LIMIT:
            raise ValueError(
                "state space too large to encode in 64 bits; use a coarser grain_ms "
                "or the Monte Carlo method (tokenrouter_ray.tuning.montecarlo)"
            )
        self.weights = np.asarray(weights.astype(np.int64))  # (3M,)

    def encode(self, fields: np.ndarray) -> np.ndarray:
        return fields @ self.weights  # (..., 3M) -> (...)


def _compositions(total: int, parts: int) -> np.ndarray:
    """All vectors of ``parts`` non-negative ints summing to ``total``: (count, parts)."""
    rows = [
        np.diff(np.array((-1, *bars, total + parts - 1))) - 1
        for bars in itertools.combinations(range(total + parts - 1), parts - 1)
    ]
    return np.asarray(rows, dtype=np.int64).reshape(-1, parts)


class _Arrivals:
    """Distribution of the arrival vector when given models finish given batch sizes: one
    column per model (requests waiting there at once) and then one per transit pair
    (requests taking off on it)."""

    def __init__(
        self, route_prob: np.ndarray, n_requests: int, pairs: list[tuple[int, int]] = ()
    ) -> None:
        self.p = route_prob
        self.models = route_prob.shape[0]
        self.m = self.models + len(pairs)  # columns of an arrival vector
        self.column = {pair: self.models + k for k, pair in enumerate(pairs)}
        self.radix = n_requests + 1
        if self.radix**self.m >= INT64_LIMIT:
            raise ValueError("too many models and transit pairs to encode an arrival vector")
        self.cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.single: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _one(self, model: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
        key = (model, batch)
        if key not in self.single:
            row = self.p[model]
            support = np.flatnonzero(row > 0)
            counts = _compositions(batch, support.size)  # (K, |support|)
            logp = (
                gammaln(batch + 1)
                - gammaln(counts + 1).sum(axis=1)
                + (counts * np.log(row[support])).sum(axis=1)
            )
            arrivals = np.zeros((counts.shape[0], self.m), dtype=np.int64)  # (K, M + P)
            columns = [self.column.get((model, int(j)), int(j)) for j in support]
            arrivals[:, columns] = counts
            self.single[key] = (arrivals, np.exp(logp))
        return self.single[key]

    def get(self, finish_key: int, batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``batches[i]`` requests finish on model i (0 for models not finishing)."""
        if finish_key in self.cache:
            return self.cache[finish_key]
        arrivals = np.zeros((1, self.m), dtype=np.int64)
        probs = np.ones(1)
        for model in np.flatnonzero(batches):
            a, q = self._one(int(model), int(batches[model]))
            arrivals = (arrivals[:, None, :] + a[None, :, :]).reshape(-1, self.m)
            probs = (probs[:, None] * q[None, :]).reshape(-1)
            codes = arrivals @ (self.radix ** np.arange(self.m))
            codes, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
            probs = np.bincount(inverse.reshape(-1), weights=probs, minlength=codes.size)
            arrivals = arrivals[first]
        self.cache[finish_key] = (arrivals, probs)
        return arrivals, probs

    def ragged(
        self, keys: np.ndarray, batches: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Concatenated arrival distributions for distinct finish keys.

        Returns arrivals (K_total, M), probs (K_total,), and per key its offset and count.
        """
        dists = [self.get(int(k), b) for k, b in zip(keys, batches, strict=True)]
        counts = np.array([q.size for _, q in dists], dtype=np.int64)  # (U,)
        offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))  # (U,)
        arrivals = np.concatenate([a for a, _ in dists])  # (K_total, M)
        probs = np.concatenate([q for _, q in dists])  # (K_total,)
        return arrivals, probs, offsets, counts


def _launch(
    waiting: np.ndarray, batch: np.ndarray, left: np.ndarray, inputs: ChainInputs
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Apply the launch rule to (..., M) arrays; returns new (k, b, r)."""
    go = (batch == 0) & (waiting >= inputs.thresholds) & (waiting > 0)
    size = np.minimum(waiting, inputs.max_batch)
    model = np.arange(inputs.num_models)
    new_left = inputs.grains[model, size]
    return (
        np.where(go, waiting - size, waiting),
        np.where(go, size, batch),
        np.where(go, new_left, left),
    )


def _split(fields: np.ndarray, m: int) -> tuple[np.ndarray, ...]:
    """(k, b, r) per model (..., M) each, then (f, e) per transit pair (..., P) each."""
    models, flights = fields[..., : 3 * m], fields[..., 3 * m :]
    return (
        models[..., 0::3],
        models[..., 1::3],
        models[..., 2::3],
        flights[..., 0::2],
        flights[..., 1::2],
    )


def _join(
    waiting: np.ndarray,
    batch: np.ndarray,
    left: np.ndarray,
    flying: np.ndarray | None = None,
    landing_in: np.ndarray | None = None,
) -> np.ndarray:
    m = waiting.shape[-1]
    p = 0 if flying is None else flying.shape[-1]
    out = np.empty((*waiting.shape[:-1], 3 * m + 2 * p), dtype=np.int64)
    out[..., 0 : 3 * m : 3], out[..., 1 : 3 * m : 3], out[..., 2 : 3 * m : 3] = waiting, batch, left
    if p:
        out[..., 3 * m :: 2], out[..., 3 * m + 1 :: 2] = flying, landing_in
    return out


def start_state(inputs: ChainInputs) -> np.ndarray:
    """All N requests waiting at model 0, nothing in flight, then launches: (1, 3M + 2P)."""
    m, p = inputs.num_models, len(inputs.transit_pairs())
    waiting = np.zeros((1, m), dtype=np.int64)
    waiting[0, 0] = inputs.n_requests
    zero = np.zeros_like(waiting)
    none = np.zeros((1, p), dtype=np.int64)
    return _join(*_launch(waiting, zero, zero, inputs), none, none)


def _land(
    fields: np.ndarray, inputs: ChainInputs, pairs: list[tuple[int, int]]
) -> tuple[np.ndarray, ...]:
    """Roll each state forward through the landings due before its next batch completion
    (deterministic: no routing happens there); each landing's requests wait at their model
    and the launch rule runs. Returns (k, b, r) per model, (f, e) per pair, the grains that
    passed, and the grains from there to the next completion (``tau``)."""
    m = inputs.num_models
    waiting, batch, left, flying, landing_in = (a.copy() for a in _split(fields, m))
    never = np.iinfo(np.int64).max
    passed = np.zeros(fields.shape[0], dtype=np.int64)
    for _ in range(len(pairs) + 1):  # each pair lands at most once between completions
        running, aloft = batch > 0, flying > 0
        if not (running.any(axis=1) | aloft.any(axis=1)).all():
            raise AssertionError("a state with no running model and nothing in flight: deadlock")
        tau = np.where(running, left, never).min(axis=1)  # (n,)
        land = np.where(aloft, landing_in, never).min(axis=1) if pairs else tau
        early = land < tau  # (n,) a landing comes first
        if not early.any():
            return waiting, batch, left, flying, landing_in, passed, tau
        dt = np.where(early, land, 0)[:, None]
        landing = aloft & (landing_in == dt) & early[:, None]  # (n, P)
        for k, (_, j) in enumerate(pairs):
            waiting[:, j] += np.where(landing[:, k], flying[:, k], 0)
        flying = np.where(landing, 0, flying)
        landing_in = np.where(landing, 0, np.where(aloft, landing_in - dt, 0))
        left = np.where(running, left - dt, 0)
        passed += dt[:, 0]
        launched = _launch(waiting, batch, left, inputs)
        waiting, batch, left = (np.where(early[:, None], new, old) for new, old in
                                zip(launched, (waiting, batch, left), strict=True))  # fmt: skip
    raise AssertionError("more landings than transit pairs before a completion")


def _expand(
    fields: np.ndarray, inputs: ChainInputs, arrivals: _Arrivals, pairs: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One completion event out of each state (after the landings before it): (src row,
    next fields, prob) per edge, reward, tau (the grains from the state to the event)."""
    m = inputs.num_models
    waiting, batch, left, flying, landing_in, passed, tau = _land(fields, inputs, pairs)
    running, aloft = batch > 0, flying > 0
    finishing = running & (left == tau[:, None])
    done = np.where(finishing, batch, 0)  # (n, M) requests leaving each model
    reward = done @ inputs.tokens_per_request
    batch_after = np.where(finishing, 0, batch)
    left_after = np.where(running & ~finishing, left - tau[:, None], 0)
    landing = aloft & (landing_in == tau[:, None])  # (n, P) groups landing with it
    for k, (_, j) in enumerate(pairs):
        waiting[:, j] += np.where(landing[:, k], flying[:, k], 0)
    still = aloft & ~landing
    flying_after = np.where(still, flying, 0)
    landing_after = np.where(still, landing_in - tau[:, None], 0)
    tau = tau + passed

    finish_key = done @ (arrivals.radix ** np.arange(m))
    keys, first, inverse = np.unique(finish_key, return_index=True, return_inverse=True)
    table, probs, offsets, counts = arrivals.ragged(keys, done[first])
    inverse = inverse.reshape(-1)
    per_state = counts[inverse]  # (n,) outcomes of each state's event
    src = np.repeat(np.arange(fields.shape[0]), per_state)  # (E,)
    starts = np.cumsum(per_state) - per_state
    slot = np.arange(src.size) - starts[src] + offsets[inverse][src]  # (E,) row in table
    arrived = table[slot]  # (E, M + P)
    model_part = _launch(waiting[src] + arrived[:, :m], batch_after[src], left_after[src], inputs)
    if pairs:
        off = arrived[:, m:]  # (E, P) taking off now
        if ((off > 0) & (flying_after[src] > 0)).any():
            raise AssertionError("two groups in flight on one pair (transit too long)")
        d = np.array([inputs.transit[i, j] for i, j in pairs], dtype=np.int64)  # (P,)
        nxt = _join(
            *model_part,
            flying_after[src] + off,
            np.where(off > 0, d, landing_after[src]),
        )
    else:
        nxt = _join(*model_part)
    prob = probs[slot]
    keep = prob > 0
    return src[keep], nxt[keep], prob[keep], reward, tau


def build_chain(inputs: ChainInputs, max_states: int | None = None) -> Chain:
    """Enumerate the states reachable from ``start_state`` and their transitions;
    ``ChainTooLarge`` as soon as more than ``max_states`` are found."""
    inputs.check_transit()
    pairs = inputs.transit_pairs()
    transits = [int(inputs.transit[i, j]) for i, j in pairs] if pairs else []
    codec = _Codec(inputs.n_requests, inputs.grains.max(axis=1), transits)
    arrivals = _Arrivals(inputs.route_prob, inputs.n_requests, pairs)

    frontier = start_state(inputs)
    known = codec.encode(frontier)  # sorted keys of every state seen so far
    found_fields, found_keys = [frontier], [known]
    edge_src, edge_dst, edge_prob, rewards, taus = [], [], [], [], []
    offset = 0
    while frontier.shape[0]:
        src, nxt, prob, reward, tau = _expand(frontier, inputs, arrivals, pairs)
        dst = codec.encode(nxt)
        edge_src.append(src + offset)
        edge_dst.append(dst)
        edge_prob.append(prob)
        rewards.append(reward)
        taus.append(tau)
        offset += frontier.shape[0]

        pos = np.searchsorted(known, dst).clip(max=known.size - 1)
        unseen = np.flatnonzero(known[pos] != dst)
        cand, first = np.unique(dst[unseen], return_index=True)
        frontier = nxt[unseen[first]]
        known = np.insert(known, np.searchsorted(known, cand), cand)
        if max_states is not None and known.size > max_states:
            raise ChainTooLarge(f"more than {max_states} states")
        found_fields.append(frontier)
        found_keys.append(cand)

    fields = np.concatenate(found_fields)
    keys = np.concatenate(found_keys)  # discovery order, same as rows of fields
    order = np.argsort(keys)
    cols = order[np.searchsorted(keys, np.concatenate(edge_dst), sorter=order)]
    n = keys.size
    transition = sp.csr_matrix(
        (np.concatenate(edge_prob), (np.concatenate(edge_src), cols)), shape=(n, n)
    )
    return Chain(
        fields=fields,
        transition=transition,
        reward=np.concatenate(rewards),
        tau=np.concatenate(taus),
    )
