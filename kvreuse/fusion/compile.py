"""Compiling a chunk: prefill it alone and keep its stored-form KV (keys before RoPE), ready to be placed
anywhere. LegoLink-0 compiles behind dummy tokens whose KV is dropped, so the chunk carries no attention sink;
every compiled entry also carries CacheTune's offline frequency ranking."""

from __future__ import annotations

from typing import Literal

import torch

from kvreuse.model.runtime import LayerwiseModel
from kvreuse.store.entry import EntryMeta, KVEntry, dtype_name
from kvreuse.store.keys import compile_mode as compile_mode_name

LOW_PASS_SHARE = 0.5  # CacheTune's alpha: the share of the lowest frequency bins kept
Band = Literal["low", "high"]


def band_norms(
    keys: torch.Tensor, values: torch.Tensor, alpha: float = LOW_PASS_SHARE, band: Band = "low"
) -> torch.Tensor:
    """Per-token L2 norms of a chunk's K and V ([layers, tokens, heads, dim]) filtered along the tokens to the
    lowest `alpha` share of rFFT bins (band "low", CacheTune's low-pass) or to the others ("high"):
    [2 (K, V), layers, tokens]."""
    if band not in ("low", "high"):
        raise ValueError(f"band must be 'low' or 'high', got {band!r}")
    n = keys.shape[1]
    kv = torch.stack([keys, values]).float().flatten(3)  # [2, layers, tokens, heads * dim]
    spectrum = torch.fft.rfft(kv, dim=2)
    cutoff = max(1, round(alpha * spectrum.shape[2]))
    if band == "low":
        spectrum[:, :, cutoff:] = 0
    else:
        spectrum[:, :, :cutoff] = 0
    return torch.fft.irfft(spectrum, n=n, dim=2).norm(dim=3)


def layer_averaged_ranking(score: torch.Tensor) -> torch.Tensor:
    """[layers, tokens] scores -> one score per token: min-max normalised per layer, averaged over layers."""
    low, high = score.min(1, keepdim=True).values, score.max(1, keepdim=True).values
    return ((score - low) / (high - low).clamp_min(1e-12)).mean(0)


def frequency_ranking(keys: torch.Tensor, values: torch.Tensor, alpha: float = LOW_PASS_SHARE) -> torch.Tensor:
    """CacheTune's per-token score from a chunk's KV ([layers, tokens, heads, dim]).

    Per layer: rFFT of K and V along the tokens, keep the lowest `alpha` share of bins, transform back, score a
    token by the mean of the L2 norms of its filtered K and V; min-max normalise per layer, average over layers.
    """
    return layer_averaged_ranking(band_norms(keys, values, alpha).mean(0))


def compile_chunk(
    model: LayerwiseModel,
    token_ids: list[int],
    key: str,
    model_fingerprint: str,
    dummy_tokens: int = 0,
    dummy_token_id: int = 0,
) -> KVEntry:
    prefill = model.prefill([dummy_token_id] * dummy_tokens + list(token_ids), capture_kv=True)
    keys, values = prefill.keys[:, dummy_tokens:].contiguous(), prefill.values[:, dummy_tokens:].contiguous()
    meta = EntryMeta(
        model_fingerprint=model_fingerprint,
        dtype=dtype_name(keys.dtype),
        num_layers=model.num_layers,
        num_tokens=len(token_ids),
        compile_mode=compile_mode_name(dummy_tokens),
        ranking=frequency_ranking(keys, values).to(keys.dtype),
    )
    return KVEntry(key, keys, values, meta)
