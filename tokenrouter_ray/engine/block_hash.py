"""Content hashes of full KV blocks, chained from the first block (prefix caching).

A block's hash covers its own token ids and its parent's hash, so equal hashes mean equal
prefixes, not just equal blocks. The first block also covers the request's extra keys (its
``cache_salt``): requests with different salts never share a block. Hashes are 128-bit
BLAKE2b digests of the token ids' bytes, stable across processes, so the ingress's
cache-aware chooser (``ingress/affinity.py``) and the engines agree on them. No torch here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 16-byte digest


def extra_keys(cache_salt: str | None) -> bytes:
    """What besides the tokens separates caches: the tenant's salt (empty: none)."""
    if cache_salt is None:
        return b""
    raw = cache_salt.encode()
    return len(raw).to_bytes(4, "little") + raw


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """The hash of one full block given its parent's hash (``None`` for the first block,
    which covers ``extra`` too)."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"\x00" + extra)
    else:
        h.update(b"\x01" + parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra: bytes = b"",
) -> list[BlockHash]:
    """Grow ``hashes`` (the chain of the first ``len(hashes)`` full blocks of
    ``token_ids``) in place to ``num_blocks`` full blocks (never past the full ones) and
    return it."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids`` (fewer if shorter)."""
    return extend_block_hashes([], token_ids, block_size, num_blocks, extra_keys(cache_salt))
