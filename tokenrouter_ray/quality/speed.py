"""Serve the top model alone while routing is slower (``tuner.speed_bypass``).

Routing pays for itself only where the small model's cheap steps outweigh the handoffs and
the large model's re-steps. Whether they do depends on the hardware (two models sharing the
cores of one CPU, or each its own GPU), the traffic (how much of it the policy escalates)
and the load. This guard measures it: every request that asks for no ``routing`` and whose
quality rung routes (a preset, or the policy's own thresholds) is served either routed or
by the top model alone (bypass), and its time per output token (admission to its last
token, over its output tokens) is recorded under its mode and its load (the ingress's
active requests at admission, in powers of two: 1, 2-3, 4-7, ...).

Per load level:

- once both modes have ``min_samples`` requests there, the faster mode serves, by its mean
  time per token over the last ``window`` requests; the other takes over only once it is
  faster by ``margin`` (hysteresis);
- before that, the mode the nearest decided load level serves (the direction changes
  slowly with load), measured here as it serves; with no level decided yet, the less
  measured mode serves the next request (learning, at the start only);
- every ``explore_every``-th request goes to the other mode, so a change in traffic or
  load is seen (its cost is at most 1/``explore_every`` of the gap between the two). The
  count, not a draw: two requests in a row are never both explorations.

Bypass never lowers quality: the top model alone is the answer every routed operating
point is judged against (``quality/target.py``). A request the quality target already
sends to the top model alone, or that names its own ``routing``, is not the guard's."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenrouter_ray.quality.settings import SpeedBypassSpec

HISTORY = 100  # mode changes the status route lists
# The tuner's prediction per N: (routed tokens/s, alone tokens/s)
Prediction = tuple[dict[int, float], dict[int, float]]
MODES = ("routed", "alone")


def load_level(active: int) -> int:
    """The load level of ``active`` requests (this one included): 1, 2-3, 4-7, ... -> 0, 1,
    2, ... (powers of two: the levels a closed loop of N clients lands on)."""
    return max(active, 1).bit_length() - 1


class _Level:
    """One load level's measurements and choice."""

    def __init__(self, window: int) -> None:
        self.times = {mode: deque[float](maxlen=window) for mode in MODES}
        self.counts = dict.fromkeys(MODES, 0)  # requests measured, ever
        self.mode: str | None = None  # decided once both modes are measured
        self.served = 0  # requests placed since the decision (the exploration count)

    def mean(self, mode: str) -> float | None:
        values = self.times[mode]
        return sum(values) / len(values) if values else None


class SpeedBypass:
    """Chooses routed or alone per request; learns from the requests it chose."""

    def __init__(self, spec: SpeedBypassSpec, top: str) -> None:
        self.spec = spec
        self.top = top
        self.levels: dict[int, _Level] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    def _level(self, level: int) -> _Level:
        found = self.levels.get(level)
        if found is None:
            found = self.levels[level] = _Level(self.spec.window)
        return found

    def choose(self, active: int) -> tuple[str, str, int]:
        """(mode, why, load level) for a request admitted with ``active`` requests in the
        ingress (itself included). why: ``learning``, ``speed`` (the faster mode) or
        ``explore``."""
        level = load_level(active)
        state = self._level(level)
        if state.mode is None and all(len(state.times[m]) >= self.spec.min_samples for m in MODES):
            self._decide(level, state)
        mode = state.mode if state.mode is not None else self._nearest(level)
        if mode is None:
            # the less measured mode; a tie goes to the configured start
            short = [m for m in MODES if len(state.times[m]) < self.spec.min_samples]
            mode = min(short, key=lambda m: (state.counts[m], m != self.spec.start))
            return mode, "learning", level
        state.served += 1
        every = self.spec.explore_every
        if every and state.served % every == 0:
            return _other(mode), "explore", level
        return mode, "speed", level

    def _nearest(self, level: int) -> str | None:
        """The mode of the decided load level nearest ``level`` (the lower on a tie)."""
        decided = [k for k, s in self.levels.items() if s.mode is not None]
        if not decided:
            return None
        return self.levels[min(decided, key=lambda k: (abs(k - level), k))].mode

    def observe(self, mode: str, level: int, seconds: float, tokens: int) -> None:
        """A request this guard placed, finished: ``tokens`` output tokens ``seconds`` after
        admission."""
        if tokens < self.spec.min_tokens or seconds <= 0:
            return
        state = self._level(level)
        state.times[mode].append(seconds / tokens)
        state.counts[mode] += 1
        if state.mode is not None:
            self._decide(level, state)

    def _decide(self, level: int, state: _Level) -> None:
        routed, alone = state.mean("routed"), state.mean("alone")
        if routed is None or alone is None:
            return
        best = "alone" if alone < routed else "routed"
        if state.mode is None:
            self._move(level, state, best, routed, alone, "both modes measured")
        elif best != state.mode:
            current = state.mean(state.mode)
            other = state.mean(best)
            assert current is not None and other is not None
            if other <= current * (1 - self.spec.margin):
                self._move(level, state, best, routed, alone, "faster by the margin")

    def _move(
        self, level: int, state: _Level, mode: str, routed: float, alone: float, why: str
    ) -> None:
        self.history.append({
            "at": time.time(), "load": _level_name(level), "from": state.mode, "to": mode,
            "reason": why, "routed_ms_per_token": routed * 1e3,
            "alone_ms_per_token": alone * 1e3,
        })  # fmt: skip
        state.mode = mode

    def status(self, predicted: Prediction | None = None) -> dict[str, Any]:
        """The ``speed_bypass`` part of ``GET /v1/tokenrouter/quality``; with the tuner's
        latest ``predicted`` tokens/s per N (routed, alone), each level also shows the
        routed / alone throughput ratio the Markov model predicts at its lowest N beside
        the one measured (the alone mean over the routed mean time per token)."""
        levels = []
        for level in sorted(self.levels):
            state = self.levels[level]
            routed, alone = state.mean("routed"), state.mean("alone")
            levels.append({
                "load": _level_name(level),
                "mode": state.mode,
                **{f"{m}_ms_per_token": _ms(state.mean(m)) for m in MODES},
                "measured": dict(state.counts),
                "routed_over_alone": {
                    "measured": None if not (routed and alone) else round(alone / routed, 3),
                    "predicted": _predicted_ratio(predicted, 1 << level),
                },
            })  # fmt: skip
        return {
            "top": self.top,
            "explore_every": self.spec.explore_every,
            "margin": self.spec.margin,
            "levels": levels,
            "moves": list(self.history),
        }


def _predicted_ratio(predicted: Prediction | None, n: int) -> float | None:
    """Routed over alone tokens/s at the predicted N nearest ``n`` (None: no prediction)."""
    if not predicted:
        return None
    routed, alone = predicted
    common = [k for k in routed if k in alone and alone[k] > 0]
    if not common:
        return None
    nearest = min(common, key=lambda k: (abs(k - n), k))
    return round(routed[nearest] / alone[nearest], 3)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _other(mode: str) -> str:
    return "alone" if mode == "routed" else "routed"


def _level_name(level: int) -> str:
    low, high = 1 << level, (1 << (level + 1)) - 1
    return str(low) if low == high else f"{low}-{high}"
