"""Prefix-cache keys: the chained hash of a full KV block.

A block's hash covers its parent block's hash, its token ids and any extra keys (on the first block: the request's
cache salt and the id of the LoRA adapter it runs with), so equal hashes mean equal prefixes up to and including the
block. SHA-256 of a fixed binary encoding, as vLLM's default: collisions are out of reach, unlike Python's hash().
The chain starts from a random per-process seed, so hashes cannot be predicted across processes (timing probes),
unless PYTHONHASHSEED is set, which makes runs reproducible.
"""
from __future__ import annotations

import hashlib
import os
from array import array


def _root_hash() -> bytes:
    seed = os.environ.get("PYTHONHASHSEED")
    return hashlib.sha256(seed.encode()).digest() if seed else os.urandom(32)


ROOT_HASH = _root_hash()


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], extra_key: str | None = None,
                      lora_int_id: int | None = None) -> bytes:
    digest = hashlib.sha256(parent_hash or ROOT_HASH)
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(b"\x00salt\x00" + extra_key.encode())
    if lora_int_id is not None:  # a LoRA adapter's K/V differ from the base model's: never shared
        digest.update(b"\x00lora\x00" + array("q", [lora_int_id]).tobytes())
    return digest.digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: list[int], block_size: int,
                        cache_salt: str | None = None, lora_int_id: int | None = None) -> None:
    """Append the hashes of the full blocks of `token_ids` that `block_hashes` does not cover yet. The salt and
    the adapter id go into the first block's hash, which every later one chains from."""
    for start in range(len(block_hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hashes[-1] if block_hashes else None
        first = start == 0
        block_hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size],
                                              cache_salt if first else None, lora_int_id if first else None))
