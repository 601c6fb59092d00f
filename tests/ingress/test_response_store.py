"""The Responses API's store (ingress/response_store.py): both bounds, least recently used
first, a running background entry never evicted, an entry too large alone not stored."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenrouter_ray.ingress.response_store import ResponseStore, StoredResponse, json_size


def entry(text: str = "x") -> StoredResponse:
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]
    return StoredResponse({"id": "r", "output": []}, items, json_size(items))


def test_count_bound_evicts_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2, max_bytes=1 << 20)
    assert store.put("resp_a", entry()) and store.put("resp_b", entry())
    assert store.get("resp_a") is not None  # a read is a use: b is now the oldest
    assert store.put("resp_c", entry())
    assert "resp_b" not in store and "resp_a" in store and "resp_c" in store
    assert len(store) == 2 and store.evicted == 1
    assert store.bytes == sum(store.get(k).size for k in ("resp_a", "resp_c"))  # type: ignore[union-attr]


def test_byte_bound_and_an_entry_too_large_alone() -> None:
    one = entry("y" * 100)
    size = one.items_bytes + json_size(one.response)
    store = ResponseStore(max_responses=100, max_bytes=2 * size + size // 2)
    for name in ("resp_a", "resp_b", "resp_c"):
        assert store.put(name, entry("y" * 100))
    assert list(k for k in ("resp_a", "resp_b", "resp_c") if k in store) == ["resp_b", "resp_c"]
    assert store.bytes == 2 * size <= store.max_bytes
    assert not store.put("resp_big", entry("z" * 3 * size))  # larger than the store alone
    assert "resp_big" not in store and store.too_large == 1 and len(store) == 2
    # a response that grows past the store alone is dropped; one that fits evicts others
    assert not store.set_response("resp_c", {"output": ["w" * 3 * size]})
    assert "resp_c" not in store and store.bytes == size
    assert not store.set_response("resp_gone", {})
    popped = store.pop("resp_b")
    assert popped is not None and store.bytes == 0 and len(store) == 0


def test_a_running_background_response_is_never_evicted() -> None:
    async def go() -> dict[str, Any]:
        store = ResponseStore(max_responses=1, max_bytes=1 << 20)
        running = entry()
        running.run = asyncio.ensure_future(asyncio.sleep(10))
        store.put("resp_bg", running)
        store.put("resp_a", entry())  # over the count, but the running one stays
        kept = {k: k in store for k in ("resp_bg", "resp_a")}
        store.put("resp_b", entry())  # the finished resp_a goes instead
        after = {k: k in store for k in ("resp_bg", "resp_a", "resp_b")}
        stats = store.stats()
        running.run.cancel()
        await asyncio.wait({running.run})
        store.put("resp_c", entry())  # no longer running: evicted like any other
        return {"kept": kept, "after": after, "stats": stats, "last": sorted(store._entries)}

    got = asyncio.run(go())
    assert got["kept"] == {"resp_bg": True, "resp_a": True}
    assert got["after"] == {"resp_bg": True, "resp_a": False, "resp_b": True}
    assert got["stats"]["running"] == 1 and got["stats"]["count"] == 2
    assert got["last"] == ["resp_c"]
