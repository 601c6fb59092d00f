"""Replica placement: the one rule that picks a request's replica of each model.

A request uses one replica of every model it visits, chosen once and kept (its KV lives
there). ``Placement.place`` chooses them when the request is placed: for each model, the
replica that last received the prompt's longest remembered prefix (``PrefixAffinity``,
ingress/affinity.py: its KV cache likely holds it) unless that replica has more than
``max_imbalance`` requests more than the least loaded one; otherwise, and for a request
without a prompt or a model with one replica, the least loaded replica (ties: the first in
``replicas_of`` order). The load of a replica is the number of requests placed on it and
not yet ``release``-d: the ingress counts them, no replica is asked.

``replace(rid)`` is the same rule for a request re-created after a replica loss
(ingress/recovery.py): each replica it was placed on that is still live is kept, each lost
one is chosen anew for the remembered prompt. ``forget(endpoint)`` drops a lost replica's
remembered prefixes.

Who uses it: the ingress for new requests and for recovery (``IngressServer``,
ingress/openai_server.py), and ``LocalRuntime`` / ``ReplicatedRuntime`` (local.py,
simulation/backend.py), so simulated results describe the placement production does.
Pure and synchronous: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tokenrouter_ray.ingress.affinity import PrefixAffinity


@dataclass
class _Placed:
    prompt: Sequence[int] | None
    cache_salt: str | None
    endpoints: dict[str, str] = field(default_factory=dict)  # model -> replica


class Placement:
    """Prefix affinity bounded by load, per model (see the module docstring)."""

    def __init__(
        self,
        replicas_of: Callable[[str], Sequence[str]],
        block_sizes: Mapping[str, int] | None = None,
        max_imbalance: int = 4,
        depth: int = 64,
    ) -> None:
        self.replicas_of = replicas_of  # model -> its live replicas (endpoint names)
        self.block_sizes = dict(block_sizes or {})
        self.max_imbalance = max_imbalance
        self.depth = depth
        self.load: dict[str, dict[str, int]] = {}  # model -> replica -> requests placed now
        self.affinity: dict[str, PrefixAffinity] = {}  # model -> its prefix memory
        self._placed: dict[str, _Placed] = {}  # rid -> where it was placed

    def load_of(self, model: str) -> dict[str, int]:
        """Requests placed on each replica of ``model`` and not released (a live dict)."""
        return self.load.setdefault(model, {})

    def choose(
        self, model: str, prompt: Sequence[int] | None = None, cache_salt: str | None = None
    ) -> str:
        """The replica of ``model`` for a prompt, without counting it (``place`` counts).
        ``LookupError`` when the model has no replica."""
        options = list(self.replicas_of(model))
        if not options:
            raise LookupError(f"no replica of model {model!r} is registered")
        counts = self.load_of(model)
        loads = {e: counts.get(e, 0) for e in options}
        if prompt is None or len(loads) < 2:
            return min(loads, key=loads.__getitem__)
        return self._chooser(model).choose(prompt, loads, cache_salt)

    def place(
        self,
        rid: str,
        models: Iterable[str],
        prompt: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, str]:
        """Choose and count ``rid``'s replica of each of ``models``; a model that has no
        replica raises ``LookupError`` with nothing counted for this call."""
        chosen = {model: self.choose(model, prompt, cache_salt) for model in models}
        placed = self._placed.setdefault(rid, _Placed(prompt, cache_salt))
        for model, endpoint in chosen.items():
            self._move(placed, model, endpoint)
        return chosen

    def replace(self, rid: str, models: Iterable[str]) -> dict[str, str]:
        """``rid``'s replicas of ``models`` after a loss: each one still live is kept, each
        lost one is chosen anew (for the prompt it was placed with) and counted there."""
        placed = self._placed.setdefault(rid, _Placed(None, None))
        out: dict[str, str] = {}
        for model in models:
            endpoint = placed.endpoints.get(model)
            if endpoint is None or endpoint not in self.replicas_of(model):
                endpoint = self.choose(model, placed.prompt, placed.cache_salt)
                self._move(placed, model, endpoint)
            out[model] = endpoint
        return out

    def placed(self, rid: str) -> dict[str, str]:
        """Where ``rid`` is placed now (model -> replica); empty when it is not."""
        found = self._placed.get(rid)
        return dict(found.endpoints) if found is not None else {}

    def release(self, rid: str) -> None:
        """``rid`` ended: its replicas carry one request less (a no-op when not placed)."""
        placed = self._placed.pop(rid, None)
        if placed is None:
            return
        for model, endpoint in placed.endpoints.items():
            self.load_of(model)[endpoint] -= 1

    def release_model(self, rid: str, models: Iterable[str]) -> None:
        """Release only ``rid``'s replicas of ``models`` (the rest stays placed)."""
        placed = self._placed.get(rid)
        if placed is None:
            return
        for model in models:
            endpoint = placed.endpoints.pop(model, None)
            if endpoint is not None:
                self.load_of(model)[endpoint] -= 1
        if not placed.endpoints:
            del self._placed[rid]

    def forget(self, endpoint: str) -> None:
        """A replica is gone: no prefix is sent to it for its cache any more."""
        for chooser in self.affinity.values():
            chooser.forget(endpoint)

    def _move(self, placed: _Placed, model: str, endpoint: str) -> None:
        counts = self.load_of(model)
        old = placed.endpoints.get(model)
        if old is not None:
            counts[old] -= 1
        placed.endpoints[model] = endpoint
        counts[endpoint] = counts.get(endpoint, 0) + 1

    def _chooser(self, model: str) -> PrefixAffinity:
        chooser = self.affinity.get(model)
        if chooser is None:
            chooser = self.affinity[model] = PrefixAffinity(
                self.block_sizes.get(model, 16), self.depth, self.max_imbalance
            )
        return chooser
