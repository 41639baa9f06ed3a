"""Content-addressed keys for chunks and prefix blocks.

Hash: BLAKE3 (256-bit, hex). It is stable across platforms and Python versions (unlike `hash()`), several
times faster than SHA-256 on this machine (2.5 vs 1.4 GB/s single-threaded), and collision-resistant, so a
key names its content: two entries with one key hold the same KV.

Everything that changes the KV goes into the key: the model fingerprint (architecture, weights identity,
dtype), the tokenizer fingerprint, the compile mode (plain, or LegoLink-0 behind n dummy tokens) and the token
ids. A cache salt isolates tenants: entries under different salts never share a key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import blake3
import numpy as np

DEFAULT_BLOCK_SIZE = 256
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")


class InvalidKey(ValueError):
    """A key that is not a store key (and could, used as a path or Redis name, escape its namespace)."""


def check_key(key: str) -> str:
    """Return `key` if it is a valid store key; keys from outside (cache ids) must pass this before any I/O."""
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise InvalidKey(f"invalid store key {key!r}: expected 1-128 characters from [A-Za-z0-9_-]")
    return key


def compile_mode(dummy_tokens: int = 0) -> str:
    """Name of a compile mode: 'plain', or 'legolink0:N' for a chunk compiled behind N dummy tokens."""
    if dummy_tokens < 0:
        raise ValueError(f"dummy_tokens must be >= 0, got {dummy_tokens}")
    return "plain" if dummy_tokens == 0 else f"legolink0:{dummy_tokens}"


@dataclass(frozen=True)
class KeySpace:
    """What, besides the tokens, determines a KV cache. Entries are shared only within one KeySpace."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    salt: str | None = None
    compile_mode: str = "plain"

    def digest(self) -> bytes:
        # Length-prefixed fields: ("ab", "c") and ("a", "bc") must not collide.
        h = blake3.blake3(b"kvreuse-keyspace/1")
        salt = "" if self.salt is None else "salt:" + self.salt
        for field in (self.model_fingerprint, self.tokenizer_fingerprint, salt, self.compile_mode):
            data = field.encode()
            h.update(len(data).to_bytes(8, "little") + data)
        return h.digest()


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    return len(arr).to_bytes(8, "little") + arr.astype("<i8").tobytes()


def chunk_key(token_ids: Sequence[int] | np.ndarray, space: KeySpace) -> str:
    """Key of a position-independent chunk compiled alone (positions 0..n-1)."""
    return blake3.blake3(b"chunk" + space.digest() + _token_bytes(token_ids)).hexdigest()


def prefix_block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    space: KeySpace,
    partial: bool = False,
) -> list[str]:
    """Chained keys of a prefix's blocks: block j's key hashes block j-1's key and block j's tokens, so a key
    names the whole prefix up to the end of its block. A trailing partial block gets a key only if `partial`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    stop = len(tokens) if partial else len(tokens) - len(tokens) % block_size
    parent = b"prefix" + space.digest()
    keys = []
    for start in range(0, stop, block_size):
        digest = blake3.blake3(parent + _token_bytes(tokens[start : start + block_size])).digest()
        keys.append(digest.hex())
        parent = digest
    return keys
