"""Exact prefix restoration: load-only, compute-only, Cake, CacheFlow (layer-wise, pipeline stages, batch-aware
scheduling) over one store and one model runtime. See docs/RESTORE.md."""

from kvreuse.restore.restorer import STRATEGIES, PrefixRestoration, PrefixRestorer, RestoreResult

__all__ = ["STRATEGIES", "PrefixRestoration", "PrefixRestorer", "RestoreResult"]
