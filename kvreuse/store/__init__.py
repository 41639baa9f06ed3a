"""KV-cache store: content-addressed chunks and prefix blocks in memory, disk and Redis tiers.

The store knows tensors and keys, nothing about models: it never imports transformers or kvreuse.model.
"""

from kvreuse.store.base import KVStore
from kvreuse.store.entry import EntryMeta, KVEntry
from kvreuse.store.keys import KeySpace, chunk_key, compile_mode, prefix_block_keys
from kvreuse.store.spec import open_store
from kvreuse.store.tiered import TieredStore

__all__ = ["EntryMeta", "KVEntry", "KVStore", "KeySpace", "TieredStore", "chunk_key", "compile_mode",
           "open_store", "prefix_block_keys"]
