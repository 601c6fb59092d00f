"""Cache-aware replica choice: send a prompt to the replica most likely to hold its prefix,
bounded by load.

Each model replica caches KV blocks by content (``engine/block_pool.py``), so a prompt that
shares a system prompt or a conversation's history with an earlier one prefills only its new
tail on the replica that served the earlier one, and all of it anywhere else. The ingress
cannot see the replicas' caches; like Ray Serve's prefix-aware router and SGLang's
cache-aware gateway, it remembers where it sent each prefix. ``PrefixAffinity`` keeps, for
the chained hashes of a prompt's first ``depth`` full blocks (``engine/block_hash.py``, the
engines' own hash), the replica that last received that prefix, in a bounded LRU map.

``choose(token_ids, loads)`` takes the deepest remembered prefix whose replica is live and
at most ``max_imbalance`` requests busier than the least loaded one; otherwise (no prefix
known, or its replica too busy) the least loaded replica. It then records the choice for
every prefix of the prompt. Pure and synchronous: no I/O, no clock, no torch.

Wiring: ``ingress/placement.py`` ``Placement`` (the one placement rule) keeps one
``PrefixAffinity`` per model, built with that model's block size, and calls::

    replica = affinity.choose(prompt_ids, {e: load.get(e, 0) for e in replicas_of(model)}, salt)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from tokenrouter_ray.engine.block_hash import BlockHash, prefix_block_hashes


class PrefixAffinity:
    """Prefix -> replica memory with load-bounded affinity (see the module docstring)."""

    def __init__(
        self,
        block_size: int = 16,
        depth: int = 64,
        max_imbalance: int = 4,
        capacity: int = 1 << 16,
    ) -> None:
        if block_size < 1 or depth < 1 or max_imbalance < 0 or capacity < 1:
            raise ValueError("block_size, depth, capacity must be >= 1; max_imbalance >= 0")
        self.block_size = block_size
        self.depth = depth  # prefixes remembered per prompt (full blocks from the start)
        self.max_imbalance = max_imbalance  # extra load affinity may add over the least
        self.capacity = capacity  # prefixes remembered in all
        self._owner: OrderedDict[BlockHash, str] = OrderedDict()
        self.affine = 0  # choices made by prefix (for tests and metrics)
        self.balanced = 0  # choices made by load alone

    def __len__(self) -> int:
        return len(self._owner)

    def choose(
        self, token_ids: Sequence[int], loads: Mapping[str, int], cache_salt: str | None = None
    ) -> str:
        """The replica for a prompt: ``loads`` maps each live replica to its load (e.g.
        requests in flight there). ``ValueError`` when there is none."""
        if not loads:
            raise ValueError("no replica to choose from")
        hashes = prefix_block_hashes(token_ids, self.block_size, self.depth, cache_salt)
        least = min(loads.values())
        chosen = None
        for h in reversed(hashes):  # the deepest remembered prefix first
            owner = self._owner.get(h)
            if owner in loads and loads[owner] <= least + self.max_imbalance:
                chosen = owner
                break
        if chosen is None:
            chosen = min(loads, key=loads.__getitem__)
            self.balanced += 1
        else:
            self.affine += 1
        self._remember(hashes, chosen)
        return chosen

    def forget(self, replica: str) -> int:
        """Drop what is remembered for a replica that is gone; returns how many prefixes."""
        gone = [h for h, r in self._owner.items() if r == replica]
        for h in gone:
            del self._owner[h]
        return len(gone)

    def _remember(self, hashes: list[BlockHash], replica: str) -> None:
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
