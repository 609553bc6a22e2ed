"""Automatic prefix caching: which full KV blocks hold a known token prefix, and which of them may go.

A full block is named by a hash chain (as in vLLM's automatic prefix caching): block ``j`` of a
prompt hashes its parent's hash and its own ``block_size`` token ids, and the chain starts from a
namespace of everything else that changes the KV or who may see it (the model, the request's
``cache_salt`` and, with API keys, the key that sent it: ``cache_tenant``). Two
prompts share block ``j``'s hash exactly when they share their first ``(j + 1) * block_size``
tokens (and namespace), so the longest run of known hashes from the start is the longest cached
prefix. BLAKE2b with 16-byte digests: a collision would serve another prefix's KV, so a hash of
Python's 64-bit ``hash()`` is not used.

:class:`PrefixCache` is the index only (hash <-> block id, and the least-recently-used order of
the cached blocks no sequence holds); the block manager (``block_manager.py``) owns refcounts and
the free list, and tells it when a cached block's last holder lets go or comes back.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def cache_namespace(model_identity: str, cache_salt: str = "", cache_tenant: str = "") -> bytes:
    """The root of a request's hash chain: blocks are shared only within one model, salt and tenant.

    ``cache_tenant`` (an API key's name, 64 characters at most; "" = shared by everyone) keys the
    hash: each tenant's chains come from a hash function of its own, so no salt one tenant picks can
    land in another's namespace, and "" gives the unkeyed hash of before.
    """
    return hashlib.blake2b(f"{model_identity}\0{cache_salt}".encode(), digest_size=16, key=cache_tenant.encode()).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, namespace: bytes) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` (``len(token_ids) // block_size`` of them), each
    over its parent's hash and its own tokens; a trailing partial block gets none."""
    hashes, parent = [], namespace
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + array("i", token_ids[start : start + block_size]).tobytes(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Published full blocks by hash, and an LRU order over the ones no sequence holds.

    Not thread-safe (the scheduler's lock). Block ids are the device pool's.

    Attributes:
        num_evictions: cached blocks dropped so far to make room (a running count).
    """

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._unreferenced: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        """Blocks a new request may share (held by a sequence or not)."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence holds: the pool may take them back."""
        return len(self._unreferenced)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._unreferenced

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest run of ``hashes`` from the start that is cached."""
        blocks = []
        for block_hash in hashes:
            block_id = self._by_hash.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def insert(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a held block shareable under ``block_hash``; ``False`` (nothing changes) when that
        hash is cached already (another sequence wrote the same prefix) or the block has a hash."""
        if block_hash in self._by_hash or block_id in self._hash_of:
            return False
        self._by_hash[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def release(self, block_id: int) -> None:
        """A cached block's last holder let go: it is now the most recently used evictable block."""
        self._unreferenced[block_id] = None

    def acquire(self, block_id: int) -> None:
        """An evictable block is held again (a prefix hit): it may no longer be evicted."""
        del self._unreferenced[block_id]

    def evict(self) -> int:
        """Drop the least recently used unreferenced block from the index and return its id.

        Raises:
            KeyError: no block is evictable (a block-manager bug).
        """
        block_id, _ = self._unreferenced.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block_id)]
        self.num_evictions += 1
        return block_id
