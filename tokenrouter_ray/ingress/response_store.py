"""The Responses API's stored responses on one ingress replica: a bounded, in-memory map
from response id to a `StoredResponse` (the response object as JSON, the input items it was
made from, and, while a background response generates, its task).

Entries enter with `ResponseStore.put` (a response that finished, or a background one as it
starts) and change with `ResponseStore.set_response` (a background response's end); they
leave by `pop` (``DELETE``) or eviction. Two bounds, from ``ingress.responses``
(`config.ResponseStoreSpec`): a count and bytes (the JSON size of the response object plus
its input items). Past either, the least recently used entry goes first (`get`, a read or a
continuation, counts as a use); an entry whose background task still runs is never evicted
(there are at most ``max_active_requests`` of them), so the store can exceed its bytes for
as long as they run. An entry larger than the byte bound on its own is not stored.

Everything here runs on the ingress's event loop (no lock); nothing is shared between
ingress replicas: a response is found only on the replica that made it.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact UTF-8 JSON (what an entry is measured by)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


@dataclass
class StoredResponse:
    """One stored response: its latest state, the input items it was generated from (a
    continued conversation's earlier items included) and their size."""

    response: dict[str, Any]  # the response object as JSON
    items: list[dict[str, Any]]  # never changed once stored: continuations share it
    items_bytes: int
    response_bytes: int = 0
    run: asyncio.Task[None] | None = None  # a background response's generation
    choices: list[asyncio.Task] = field(default_factory=list)  # ... and its choices' tasks

    @property
    def size(self) -> int:
        return self.items_bytes + self.response_bytes

    @property
    def running(self) -> bool:
        """A background generation still runs (the entry cannot be evicted)."""
        return self.run is not None and not self.run.done()


class ResponseStore:
    """Stored responses, least recently used first, within ``max_responses`` and
    ``max_bytes`` (the module docstring)."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        self.evicted = 0  # entries dropped for room, since start
        self.too_large = 0  # responses not stored: larger than max_bytes alone

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store ``entry`` (measuring its response), evicting others for room; False (and
        nothing stored) when it alone is larger than ``max_bytes``."""
        self.pop(response_id)
        entry.response_bytes = json_size(entry.response)
        if entry.size > self.max_bytes:
            self.too_large += 1
            return False
        self._entries[response_id] = entry
        self.bytes += entry.size
        self._evict(keep=response_id)
        return True

    def set_response(self, response_id: str, response: dict[str, Any]) -> bool:
        """A stored entry's response replaced (a background response ended); False when
        the entry is gone (deleted) or, grown past ``max_bytes`` alone, dropped."""
        entry = self._entries.get(response_id)
        if entry is None:
            return False
        self.bytes -= entry.response_bytes
        entry.response, entry.response_bytes = response, json_size(response)
        self.bytes += entry.response_bytes
        if entry.size > self.max_bytes:
            self.pop(response_id)
            self.too_large += 1
            return False
        self._evict(keep=response_id)
        return True

    def pop(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def running(self) -> Iterator[StoredResponse]:
        """The entries whose background generation still runs."""
        return (entry for entry in list(self._entries.values()) if entry.running)

    def _evict(self, keep: str) -> None:
        """Least recently used first, until within both bounds (``keep`` and running
        entries stay)."""
        for response_id in list(self._entries):
            if len(self._entries) <= self.max_responses and self.bytes <= self.max_bytes:
                return
            if response_id != keep and not self._entries[response_id].running:
                self.pop(response_id)
                self.evicted += 1

    def stats(self) -> dict[str, int]:
        """For ``/v1/tokenrouter/stats``."""
        return {
            "count": len(self._entries),
            "bytes": self.bytes,
            "running": sum(1 for _ in self.running()),
            "evicted": self.evicted,
            "too_large": self.too_large,
        }
