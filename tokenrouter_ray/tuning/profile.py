"""Routing statistics the throughput model is solved from, and how they are read.

A ``RoutingProfile`` holds, per model, the step time as a function of batch size, plus the
routing matrix ``p[i][j]`` (probability that a request finishing a step on model i goes to
model j next), the commit matrix ``c[i][j]`` (tokens committed by that move) and, optionally,
the transit matrix ``transit_ms[i][j]`` (how long a request moving from i to j spends between
the two models before it is runnable at j: the handoff's message; 0 on the diagonal, a
request that stays does not travel). It enters from a JSON/YAML file (``load_profile``), from
a plain mapping (``profile_from_mapping``) or is built directly; it leaves as numpy arrays
(``route_matrix``, ``commit_matrix``, ``grains``, ``transit_grains``).

Time discretization: a step of ``t`` ms lasts ``max(1, round(t / grain_ms))`` grains, rounding
half up. Rounding (not ceil) keeps ``27.9 / 0.1`` at 279 grains despite float error. A
transit rounds the same way but may round to 0 grains (then it is not modelled).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenrouter_ray.errors import UserFacingError

ROW_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class ModelProfile:
    """One model: its name and profiled step time (ms) per batch size.

    Batch sizes between profiled points are interpolated linearly; below the smallest point
    the smallest point's time is used; above the largest the last segment's slope is
    extended (never decreasing), or the time stays flat with a single point.
    """

    name: str
    step_ms: tuple[tuple[int, float], ...]  # sorted (batch size, ms) pairs
    max_batch: int | None = None  # a launch takes at most this many waiting requests

    def __post_init__(self) -> None:
        if not self.step_ms:
            raise ValueError(f"model {self.name!r}: empty step-time table")
        points = tuple(sorted((int(b), float(ms)) for b, ms in self.step_ms))
        for batch, ms in points:
            if batch < 1 or not ms > 0 or not math.isfinite(ms):
                raise ValueError(
                    f"model {self.name!r}: step time entry {batch}: {ms} must have "
                    "batch >= 1 and a positive finite time"
                )
        if len({b for b, _ in points}) != len(points):
            raise ValueError(f"model {self.name!r}: duplicate batch sizes in step-time table")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"model {self.name!r}: max_batch must be >= 1")
        object.__setattr__(self, "step_ms", points)

    @classmethod
    def constant(cls, name: str, ms: float, max_batch: int | None = None) -> ModelProfile:
        return cls(name=name, step_ms=((1, float(ms)),), max_batch=max_batch)

    def step_time_ms(self, batch: int) -> float:
        sizes = [b for b, _ in self.step_ms]
        times = [t for _, t in self.step_ms]
        if len(sizes) == 1 or batch <= sizes[0]:
            return times[0]
        if batch >= sizes[-1]:
            slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
            return times[-1] + max(slope, 0.0) * (batch - sizes[-1])
        return float(np.interp(batch, sizes, times))


@dataclass(frozen=True)
class RoutingProfile:
    """Everything the Markov model needs besides N and the thresholds B."""

    models: tuple[ModelProfile, ...]
    route_prob: tuple[tuple[float, ...], ...]  # p[i][j], rows sum to 1
    commit: tuple[tuple[float, ...], ...]  # c[i][j] tokens committed on a move i -> j
    grain_ms: float = 0.1
    # ms a request moving i -> j (i != j) spends between the models; None: no transit
    transit_ms: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        m = len(self.models)
        if m < 1:
            raise ValueError("a profile needs at least one model")
        names = [model.name for model in self.models]
        if len(set(names)) != m:
            raise ValueError(f"duplicate model names: {names}")
        if not self.grain_ms > 0:
            raise ValueError(f"grain_ms must be positive, got {self.grain_ms}")
        p = np.asarray(self.route_prob, dtype=float)
        c = np.asarray(self.commit, dtype=float)
        if p.shape != (m, m) or c.shape != (m, m):
            raise ValueError(f"route_prob and commit must be {m}x{m} matrices")
        if (p < 0).any() or not np.isfinite(p).all():
            raise ValueError("route probabilities must be finite and non-negative")
        if (c < 0).any() or not np.isfinite(c).all():
            raise ValueError("commit counts must be finite and non-negative")
        for i, row in enumerate(p):
            if abs(row.sum() - 1.0) > ROW_SUM_TOLERANCE:
                raise ValueError(
                    f"route probabilities out of {names[i]!r} sum to {row.sum():.9g}, not 1"
                )
        p = p / p.sum(axis=1, keepdims=True)
        object.__setattr__(self, "route_prob", tuple(tuple(row) for row in p.tolist()))
        object.__setattr__(self, "commit", tuple(tuple(row) for row in c.tolist()))
        if self.transit_ms is not None:
            d = np.asarray(self.transit_ms, dtype=float)
            if d.shape != (m, m):
                raise ValueError(f"transit_ms must be a {m}x{m} matrix")
            if (d < 0).any() or not np.isfinite(d).all():
                raise ValueError("transit times must be finite and non-negative")
            if np.diag(d).any():
                raise ValueError("a request that stays on its model does not travel: "
                                 "transit_ms must be 0 on the diagonal")  # fmt: skip
            rows = tuple(tuple(row) for row in d.tolist()) if d.any() else None
            object.__setattr__(self, "transit_ms", rows)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(model.name for model in self.models)

    @property
    def num_models(self) -> int:
        return len(self.models)

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown model {name!r}; models are {list(self.names)}") from None

    def route_matrix(self) -> np.ndarray:
        return np.asarray(self.route_prob, dtype=float)  # (M, M)

    def commit_matrix(self) -> np.ndarray:
        return np.asarray(self.commit, dtype=float)  # (M, M)

    def tokens_per_step(self) -> np.ndarray:
        """Expected tokens committed per request finishing a step on model i."""
        return (self.route_matrix() * self.commit_matrix()).sum(axis=1)  # (M,)

    def grains(self, n_requests: int, grain_ms: float | None = None) -> np.ndarray:
        """Step length in grains, ``out[i, b]`` for batch size b (``out[i, 0] = 0``)."""
        delta = self.grain_ms if grain_ms is None else grain_ms
        out = np.zeros((self.num_models, n_requests + 1), dtype=np.int64)  # (M, N + 1)
        for i, model in enumerate(self.models):
            for b in range(1, n_requests + 1):
                out[i, b] = max(1, math.floor(model.step_time_ms(b) / delta + 0.5))
        return out

    def transit_matrix(self) -> np.ndarray:
        """``out[i, j]``: ms a request moving i -> j spends between the models (M, M)."""
        if self.transit_ms is None:
            return np.zeros((self.num_models, self.num_models))
        return np.asarray(self.transit_ms, dtype=float)

    def transit_grains(self, grain_ms: float | None = None) -> np.ndarray:
        """Transit in grains, ``out[i, j]`` (M, M), rounded half up like a step; unlike a
        step it may round to 0 (then the move is instantaneous in the chain)."""
        delta = self.grain_ms if grain_ms is None else grain_ms
        return np.floor(self.transit_matrix() / delta + 0.5).astype(np.int64)

    def with_transit(self, transit_ms: float | Sequence[Sequence[float]] | None) -> RoutingProfile:
        """The same profile with a transit: one number for every move between two models,
        a matrix per pair, or None (none)."""
        if transit_ms is not None and not isinstance(transit_ms, Sequence):
            m = self.num_models
            value = float(transit_ms)
            transit_ms = [[0.0 if i == j else value for j in range(m)] for i in range(m)]
        rows = None if transit_ms is None else tuple(tuple(map(float, r)) for r in transit_ms)
        return RoutingProfile(self.models, self.route_prob, self.commit, self.grain_ms, rows)

    def max_batches(self, n_requests: int) -> np.ndarray:
        caps = [
            n_requests if m.max_batch is None else min(m.max_batch, n_requests) for m in self.models
        ]
        return np.asarray(caps, dtype=np.int64)  # (M,)

    def with_grain(self, grain_ms: float) -> RoutingProfile:
        return RoutingProfile(self.models, self.route_prob, self.commit, grain_ms, self.transit_ms)

    def permuted(self, order: Sequence[int]) -> RoutingProfile:
        """The same system with models relabelled: new model k is old model ``order[k]``."""
        idx = list(order)
        p = self.route_matrix()[np.ix_(idx, idx)]
        c = self.commit_matrix()[np.ix_(idx, idx)]
        d = self.transit_matrix()[np.ix_(idx, idx)]
        return RoutingProfile(
            tuple(self.models[i] for i in idx),
            tuple(map(tuple, p.tolist())),
            tuple(map(tuple, c.tolist())),
            self.grain_ms,
            tuple(map(tuple, d.tolist())),
        )


def _pair_matrix(
    section: Mapping[str, Any] | None, names: Sequence[str], what: str
) -> tuple[tuple[float, ...], ...]:
    """``{src: {dst: value}}`` or ``{"src:dst": value}`` to a dense matrix; missing is 0."""
    index = {name: k for k, name in enumerate(names)}
    out = [[0.0] * len(names) for _ in names]
    for key, value in (section or {}).items():
        if isinstance(value, Mapping):
            pairs = [(str(key), str(dst), v) for dst, v in value.items()]
        else:
            src, sep, dst = str(key).partition(":")
            if not sep:
                raise UserFacingError(f"{what}: key {key!r} is not of the form src:dst")
            pairs = [(src, dst, value)]
        for src, dst, v in pairs:
            for name in (src, dst):
                if name not in index:
                    raise UserFacingError(f"{what}: unknown model {name!r} (models: {names})")
            try:
                out[index[src]][index[dst]] = float(v)
            except (TypeError, ValueError):
                raise UserFacingError(f"{what}: {src}:{dst} = {v!r} is not a number") from None
    return tuple(tuple(row) for row in out)


def models_from_mapping(data: Mapping[str, Any]) -> list[ModelProfile]:
    """The ``models`` section (step times per model) of the documented file layout."""
    if not isinstance(data, Mapping) or "models" not in data:
        raise UserFacingError("profile must be a mapping with a 'models' section")
    models_section = data["models"]
    if not isinstance(models_section, Mapping) or not models_section:
        raise UserFacingError("profile 'models' must map model name -> settings")
    models = []
    for name, entry in models_section.items():
        if isinstance(entry, (int, float)):
            entry = {"step_ms": entry}
        if not isinstance(entry, Mapping) or "step_ms" not in entry:
            raise UserFacingError(f"model {name!r}: needs 'step_ms' (a number or batch->ms map)")
        step = entry["step_ms"]
        try:
            table = (
                tuple((int(b), float(ms)) for b, ms in step.items())
                if isinstance(step, Mapping)
                else ((1, float(step)),)
            )
            models.append(ModelProfile(str(name), table, entry.get("max_batch")))
        except (TypeError, ValueError) as exc:
            raise UserFacingError(f"model {name!r}: bad step_ms: {exc}") from None
    return models


def profile_from_mapping(data: Mapping[str, Any]) -> RoutingProfile:
    """Build a profile from the documented file layout (see docs/user-guide/tuning.md)."""
    models = models_from_mapping(data)
    names = [m.name for m in models]
    transit = data.get("transit_ms")
    try:
        profile = RoutingProfile(
            tuple(models),
            _pair_matrix(data.get("route_prob"), names, "route_prob"),
            _pair_matrix(data.get("commit"), names, "commit"),
            float(data.get("grain_ms", 0.1)),
        )
        if isinstance(transit, (int, float)) and not isinstance(transit, bool):
            return profile.with_transit(float(transit))
        if transit is not None:
            return profile.with_transit(_pair_matrix(transit, names, "transit_ms"))
        return profile
    except ValueError as exc:
        raise UserFacingError(str(exc)) from None


def load_profile(path: str | Path) -> RoutingProfile:
    """Read a profile from a ``.json`` or ``.yaml``/``.yml`` file."""
    return profile_from_mapping(read_profile_file(path))


def read_profile_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a ``.json`` or ``.yaml``/``.yml`` profile file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserFacingError(f"cannot read profile {path}: {exc.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise UserFacingError("reading a YAML profile needs PyYAML installed") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise UserFacingError(f"profile {path} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserFacingError(f"profile {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserFacingError(f"profile {path} must hold a mapping, not {type(data).__name__}")
    return data
