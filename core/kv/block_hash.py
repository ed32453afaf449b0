"""Prefix-cache block hashes: a block's key is a hash chained over its parent's key,
its token ids and extra keys (the request's cache salt, first block only).

    hasher = block_hasher("sha256")              # or "builtin", or one registered from outside
    h0 = hasher(None, (1, 2, 3, 4), "tenant-a")  # the first block carries the salt ...
    h1 = hasher(h0, (5, 6, 7, 8), None)          # ... every later one inherits it through h0

Two blocks share KV only if their keys are equal, so a key that can be forged lets one
user's prompt land on another user's cached KV (vLLM's CVE-2025-25183). The default,
"sha256", hashes a canonical byte encoding (below) with SHA-256: no collision is known
or constructible. "builtin" is Python's 64-bit tuple hash: fastest, but collisions are
easy to build (hash(2**61) == hash(1), hash(-1) == hash(-2)); use it only when every
prompt is trusted. Faster cryptographic-quality-enough hashes (xxHash's 128-bit XXH3)
can be registered from outside the core, which imports nothing but the stdlib:

    register_block_hasher("xxhash", make_digest_hasher(lambda b: xxhash.xxh3_128_digest(b)))

Canonical encoding (every field fixed-width or length-prefixed, so no two different
inputs give the same bytes): parent key (32 bytes; ROOT for the first block), token
count (u32 LE), token ids (i64 LE each), extra keys (u32 length + UTF-8 of repr-free
"kind:value" text, or nothing when there are none).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Callable, Hashable

# parent_key (None for the first block), token ids, extra keys (the salt, or None) -> key
BlockHasher = Callable[[Hashable, tuple, object], Hashable]

ROOT = bytes(32)           # the parent of every first block (fixed: keys are reproducible)
_COUNT = struct.Struct("<I")
_STRUCTS: dict[int, struct.Struct] = {}


def encode_block(parent: bytes | None, token_ids: tuple[int, ...], extra: object = None) -> bytes:
    """The canonical bytes of one block's identity (see the module docstring)."""
    n = len(token_ids)
    st = _STRUCTS.get(n)
    if st is None:
        st = _STRUCTS[n] = struct.Struct(f"<I{n}q")
    head = ROOT if parent is None else parent
    body = st.pack(n, *token_ids)
    if extra is None:
        return head + body
    if isinstance(extra, str):
        tail = ("s:" + extra).encode("utf-8", "surrogatepass")
    elif isinstance(extra, int):
        tail = f"i:{extra}".encode()
    else:
        raise TypeError(f"block hash extra keys must be str or int, got {type(extra).__name__}")
    return head + body + _COUNT.pack(len(tail)) + tail


def make_digest_hasher(digest: Callable[[bytes], bytes]) -> BlockHasher:
    """A BlockHasher from a bytes -> digest function (keys are the digests)."""
    def hasher(parent, token_ids, extra=None):
        return digest(encode_block(parent, token_ids, extra))
    return hasher


def sha256_block_hash(parent: bytes | None, token_ids: tuple[int, ...], extra: object = None) -> bytes:
    return hashlib.sha256(encode_block(parent, token_ids, extra)).digest()


def builtin_block_hash(parent: int | None, token_ids: tuple[int, ...], extra: object = None) -> int:
    return hash((parent, token_ids, extra))


_HASHERS: dict[str, BlockHasher] = {"sha256": sha256_block_hash, "builtin": builtin_block_hash}
DEFAULT_HASH_ALGO = "sha256"


def register_block_hasher(name: str, hasher: BlockHasher) -> None:
    """Make `name` a valid hash algorithm (backends register third-party hashes here)."""
    _HASHERS[name] = hasher


def block_hasher(name: str = DEFAULT_HASH_ALGO) -> BlockHasher:
    try:
        return _HASHERS[name]
    except KeyError:
        raise ValueError(f"unknown prefix-caching hash algorithm {name!r}; "
                         f"choose from: {', '.join(sorted(_HASHERS))}") from None


def hash_algorithms() -> list[str]:
    return sorted(_HASHERS)
