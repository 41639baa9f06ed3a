"""How a prompt's KV was obtained: the typed result the engine hands to the server, the benchmarks and the eval."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreuse.fusion.executor import FusionStats


@dataclass
class PrefixRestoreStats:
    """How the request's stored exact prefix came back."""

    strategy: str | None = None  # load, compute, cake, layerwise; None: nothing restored
    restored_tokens: int = 0  # rows [0, restored_tokens) restored from stored blocks
    # of them, loaded and recomputed, by the tier their blocks were stored on (recomputed: by the restoration's
    # compute side, or because a stored block was unreadable)
    loaded_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    recomputed_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    batch: int = 0  # requests whose prefixes were restored together with this one (1: alone)

    @property
    def loaded_tokens(self) -> int:
        return sum(self.loaded_tokens_by_tier.values())

    @property
    def recomputed_tokens(self) -> int:
        return sum(self.recomputed_tokens_by_tier.values())


@dataclass
class AutoChoiceStats:
    """What method auto chose, and the TTFT the cost model predicted for it and for the other candidates."""

    requested_method: str | None
    predicted_ttft: float
    candidates: dict[str, float]


@dataclass
class PrefillStats:
    fusion: FusionStats
    prefix: PrefixRestoreStats
    chunk_hits: int
    chunks: int
    loaded_tokens_by_tier: dict[str, int]  # chunk rows read, by the tier serving them
    auto: AutoChoiceStats | None = None
    queue_seconds: float = 0.0  # set by the serving scheduler: arrival to the start of the prefill

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was loaded from the store and kept as is (OpenAI's `cached_tokens`): stored
        chunk rows no layer recomputes at the end, and the stored prefix's rows that were loaded (not those Cake
        or CacheFlow recomputed beside the load)."""
        return self.fusion.kept_tokens + self.prefix.loaded_tokens

    def record(self) -> dict:
        """The scalar figures, flat, for JSON records (kvreuse eval's per-example results)."""
        auto = {} if self.auto is None else {"requested_method": self.auto.requested_method,
                                              "predicted_ttft": self.auto.predicted_ttft}
        return self.fusion.record() | auto | {
            "chunk_hits": self.chunk_hits, "chunks": self.chunks, "cached_tokens": self.cached_tokens,
            "prefix_restore_strategy": self.prefix.strategy, "prefix_restored_tokens": self.prefix.restored_tokens,
            "prefix_restore_seconds": self.prefix.seconds, "queue_seconds": self.queue_seconds}
