"""Measure a machine profile: time the executor's own steps with the real model, and reads from each tier.

Every figure is a median of repeated runs of exactly the code the executor calls (the runtime's qkv, rope,
attend and finish_layer; the store's get_layers), so the cost model built on them predicts the executor.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Callable

import torch

from kvreuse.controller.profile import (
    RUNTIME_REVISION,
    ComputeProfile,
    MachineProfile,
    TierProfile,
    load_profile,
    save_profile,
)
from kvreuse.model.attention import AttentionCall, attention_calls
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.store.base import KVStore
from kvreuse.store.entry import EntryMeta, KVEntry, dtype_name
from kvreuse.store.keys import KeySpace, chunk_key
from kvreuse.store.throttled import ThrottledTier

log = logging.getLogger(__name__)
ROW_GRID = [8, 32, 64, 128, 256, 512, 1024, 2048]
PROBE_LAYERS = (0, 1)  # every layer of a model has the same shape; two are timed to average out noise
TIER_PROBE_TOKENS = (16, 512)  # two entry sizes separate a read's fixed latency from its bandwidth


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: first calls allocate
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _dense_seconds(model: LayerwiseModel, rows: int, repeats: int, qkv_only: bool = False) -> float:
    """qkv, RoPE of q and k, output projection, residual and MLP of `rows` rows, per layer (or qkv only)."""
    hidden = torch.randn(rows, model.hidden_size, dtype=model.dtype)
    rotary = model.rotary(torch.arange(rows))
    attn_out = torch.randn(rows, model.num_q_heads * model.head_dim, dtype=model.dtype)

    def step(layer: int) -> None:
        q, k, _ = model.qkv(layer, hidden)
        if not qkv_only:
            model.rope(layer, q, rotary), model.rope(layer, k, rotary)
            model.finish_layer(layer, hidden, attn_out)

    return statistics.mean(_median_seconds(lambda: step(layer), repeats) for layer in PROBE_LAYERS)


def _query_layouts(context: int) -> list[torch.Tensor]:
    """Query positions as the executor sees them: a whole prompt; a few spread rows (CacheBlend's, the fresh
    tail); clusters at chunk starts (LegoLink's) before the question; the same before a recency window; most rows
    (a cold request)."""
    spread = [torch.linspace(0, context - 1, q).long().unique() for q in (24, 64, 256)]
    starts = torch.arange(0, context - 64, context // 10)
    sinks = (starts[:, None] + torch.arange(16)).flatten()
    clusters = torch.cat([sinks, torch.arange(context - 40, context)]).unique()
    window = torch.cat([sinks, torch.arange(context - context // 4, context)]).unique()
    most = torch.randperm(context)[: context * 3 // 4].sort().values
    return [torch.arange(context), *spread, clusters, window, most]


def _attention_samples(model: LayerwiseModel, repeats: int) -> list[tuple[list[AttentionCall], float]]:
    """(kernel calls, seconds) of attention as the executor runs it, over prompts of two lengths."""
    samples = []
    for context in (1024, 2048):
        keys = torch.randn(context, model.num_kv_heads, model.head_dim, dtype=model.dtype)
        values = torch.randn_like(keys)
        k_pos = torch.arange(context)
        for q_pos in _query_layouts(context):
            q = torch.randn(q_pos.numel(), model.num_q_heads, model.head_dim, dtype=model.dtype)
            seconds = _median_seconds(lambda: model.attend(0, q, q_pos, keys, values, k_pos), repeats)
            samples.append((attention_calls(q_pos, k_pos, model.windows[0]), seconds))
    return samples


def _fit_attention(samples: list[tuple[list[AttentionCall], float]]) -> tuple[float, float, float, float]:
    """Seconds per score of masked calls, per score of causal calls, per key row read and per call, by least
    squares (each kept non-negative)."""
    features = torch.tensor([[sum(c.plain_scores for c in calls), sum(c.causal_scores for c in calls),
                              sum(c.hi - c.lo for c in calls), sum(2 if c.diagonal else 1 for c in calls)]
                             for calls, _ in samples], dtype=torch.float64)
    seconds = torch.tensor([s for _, s in samples], dtype=torch.float64)
    scale = features.max(0).values.clamp_min(1)  # the columns differ by orders of magnitude (or are all 0)
    fit = torch.linalg.lstsq(features / scale, seconds[:, None]).solution[:, 0] / scale
    return tuple(float(x) for x in fit.clamp_min(0))


def _place_seconds(model: LayerwiseModel, repeats: int, rows: int = 2048) -> float:
    """Per loaded row: the stored key rotated to its position and both written into a request's cache, which is
    new for every request (so the write also pays for first touching its memory)."""
    keys = torch.randn(rows, model.num_kv_heads, model.head_dim, dtype=model.dtype)
    values = torch.randn_like(keys)
    positions = torch.arange(rows)
    rotary = model.rotary(positions)

    def place() -> None:
        cache = model.new_cache(rows)
        cache.allocate(positions)
        model.place(cache, 0, slice(0, rows), keys, values, rotary)

    return _median_seconds(place, repeats) / rows


def _request_seconds(model: LayerwiseModel, repeats: int) -> float:
    """Per request, outside the layers: embedding the computed rows, final norm and LM head of the last one."""
    ids = torch.randint(0, model.config.vocab_size, (64,))
    return _median_seconds(lambda: model.logits(model.embed(ids)[-1:]), repeats)


def _never_falling(seconds: list[float]) -> list[float]:
    """More rows never take less time, and noise only ever adds time: a count timed slower than a larger one keeps
    the larger one's time. (One slow sample of 8 rows on a busy machine made the curve fall, t_c negative, and a
    saved profile that CacheTune's ratio refused.)"""
    return [min(seconds[i:]) for i in range(len(seconds))]


@torch.inference_mode()
def measure_compute(model: LayerwiseModel, repeats: int = 5) -> ComputeProfile:
    dense = _never_falling([_dense_seconds(model, rows, repeats) for rows in ROW_GRID])
    score_seconds, causal_score_seconds, key_seconds, call_seconds = _fit_attention(_attention_samples(model, repeats))
    qkv_share = _dense_seconds(model, ROW_GRID[-1], repeats, qkv_only=True) / dense[-1]
    return ComputeProfile(ROW_GRID, dense, score_seconds, key_seconds, call_seconds, _place_seconds(model, repeats),
                          _request_seconds(model, repeats), qkv_share, causal_score_seconds)


def kv_bytes_per_token_layer(model: LayerwiseModel) -> int:
    return 2 * model.num_kv_heads * model.head_dim * model.dtype.itemsize


def _probe_entry(model: LayerwiseModel, tokens: int, model_fingerprint: str) -> KVEntry:
    shape = (model.num_layers, tokens, model.num_kv_heads, model.head_dim)
    key = chunk_key(list(range(tokens)), KeySpace(model_fingerprint, "profile", salt=f"profile-{time.time_ns()}"))
    meta = EntryMeta(model_fingerprint, dtype_name(model.dtype), model.num_layers, tokens)
    return KVEntry(key, torch.randn(shape, dtype=model.dtype), torch.randn(shape, dtype=model.dtype), meta)


def measure_tier(tier: KVStore, label: str, model: LayerwiseModel, model_fingerprint: str, repeats: int = 7
                 ) -> TierProfile:
    """Read one layer of a small and of a large entry as the executor's loader does; the two medians give the
    per-read latency and the bandwidth. The entries are deleted afterwards."""
    layer_seconds = []
    for tokens in TIER_PROBE_TOKENS:
        entry = _probe_entry(model, tokens, model_fingerprint)
        if not tier.put(entry):
            raise RuntimeError(f"profile: tier {label} refused a {entry.nbytes}-byte probe entry")
        getattr(tier, "flush", lambda: None)()  # a tiered store writes lower tiers in the background
        try:
            layer_seconds.append(_median_seconds(lambda: tier.get_layers(entry.key, 1, 2), repeats))
        finally:
            tier.delete(entry.key)
    small, large = TIER_PROBE_TOKENS
    per_token = max((layer_seconds[1] - layer_seconds[0]) / (large - small), 1e-12)
    latency = max(layer_seconds[0] - small * per_token, 0.0)
    inner = getattr(tier, "tiers", [tier])
    emulated = any(isinstance(t, ThrottledTier) for t in inner)
    return TierProfile(label, kv_bytes_per_token_layer(model) / per_token, latency, emulated,
                       reads_wait=any(t.reads_wait for t in inner))


def measure_profile(model: LayerwiseModel, model_fingerprint: str, dtype: str, tiers: dict[str, KVStore],
                    repeats: int = 5) -> MachineProfile:
    return MachineProfile(
        model=model_fingerprint,
        dtype=dtype,
        num_layers=model.num_layers,
        kv_bytes_per_token_layer=kv_bytes_per_token_layer(model),
        compute=measure_compute(model, repeats),
        tiers={label: measure_tier(tier, label, model, model_fingerprint) for label, tier in tiers.items()},
        windows=list(model.windows),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        runtime_revision=RUNTIME_REVISION,
    )


def ensure_profile(model: LayerwiseModel, model_fingerprint: str, dtype: str, tiers: dict[str, KVStore]
                   ) -> MachineProfile:
    """The saved profile of this model and dtype, with every tier in `tiers` measured: what is missing (the
    whole profile, or a tier it never saw) is measured now and saved, so it is measured once per machine."""
    profile = load_profile(model_fingerprint, dtype)
    if profile is None:
        log.warning("no usable machine profile for model %s (%s): none saved, unreadable, or measured by another "
                    "runtime revision; measuring one now (`kvreuse profile costs` refreshes it)", model_fingerprint,
                    dtype)
        profile = measure_profile(model, model_fingerprint, dtype, tiers)
    else:
        missing = {label: tier for label, tier in tiers.items() if label not in profile.tiers}
        if not missing:
            return profile
        log.warning("machine profile lacks tiers %s: measuring them now", ", ".join(missing))
        measured = {label: measure_tier(tier, label, model, model_fingerprint) for label, tier in missing.items()}
        profile = replace(profile, tiers={**profile.tiers, **measured})
    save_profile(profile)
    return profile
