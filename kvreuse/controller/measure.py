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

from kvreuse.controller.profile import ComputeProfile, MachineProfile, TierProfile, load_profile, save_profile
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
            model.rope(q, rotary), model.rope(k, rotary)
            model.finish_layer(layer, hidden, attn_out)

    return statistics.mean(_median_seconds(lambda: step(layer), repeats) for layer in PROBE_LAYERS)


def _attention_samples(model: LayerwiseModel, repeats: int) -> list[tuple[int, float]]:
    """(query-key pairs, seconds) of attention as the executor runs it: a whole prompt causally, and a few
    scattered sorted queries over a prompt in order (the shape of chunk reuse)."""
    samples = []
    for context, queries in [(512, 512), (2048, 2048), (1024, 128), (2048, 256), (2048, 64)]:
        q_pos = torch.linspace(0, context - 1, queries).long().unique()
        q = torch.randn(q_pos.numel(), model.num_q_heads, model.head_dim, dtype=model.dtype)
        keys = torch.randn(context, model.num_kv_heads, model.head_dim, dtype=model.dtype)
        values = torch.randn_like(keys)
        k_pos = torch.arange(context)
        seconds = _median_seconds(lambda: model.attend(0, q, q_pos, keys, values, k_pos), repeats)
        samples.append((int((q_pos + 1).sum()), seconds))
    return samples


def _place_seconds(model: LayerwiseModel, repeats: int, rows: int = 2048) -> float:
    """Per loaded row: the stored key rotated to its position and both written into the request's cache."""
    keys = torch.randn(rows, model.num_kv_heads, model.head_dim, dtype=model.dtype)
    values = torch.randn_like(keys)
    positions = torch.arange(rows)
    rotary = model.rotary(positions)
    cache = model.new_cache(rows)
    cache.allocate(positions)
    return _median_seconds(lambda: cache.write(0, positions, model.rope(keys, rotary), values), repeats) / rows


def _request_seconds(model: LayerwiseModel, repeats: int) -> float:
    """Per request, outside the layers: embedding the computed rows, final norm and LM head of the last one."""
    ids = torch.randint(0, model.config.vocab_size, (64,))
    return _median_seconds(lambda: model.logits(model.embed(ids)[-1:]), repeats)


@torch.inference_mode()
def measure_compute(model: LayerwiseModel, repeats: int = 5) -> ComputeProfile:
    dense = [_dense_seconds(model, rows, repeats) for rows in ROW_GRID]
    samples = _attention_samples(model, repeats)
    # least squares through the origin: attention time grows with the pairs it scores
    pair_seconds = sum(p * s for p, s in samples) / sum(p * p for p, _ in samples)
    qkv_share = _dense_seconds(model, ROW_GRID[-1], repeats, qkv_only=True) / dense[-1]
    return ComputeProfile(ROW_GRID, dense, pair_seconds, _place_seconds(model, repeats),
                          _request_seconds(model, repeats), qkv_share)


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
    emulated = any(isinstance(t, ThrottledTier) for t in getattr(tier, "tiers", [tier]))
    return TierProfile(label, kv_bytes_per_token_layer(model) / per_token, latency, emulated)


def measure_profile(model: LayerwiseModel, model_fingerprint: str, dtype: str, tiers: dict[str, KVStore],
                    repeats: int = 5) -> MachineProfile:
    return MachineProfile(
        model=model_fingerprint,
        dtype=dtype,
        num_layers=model.num_layers,
        kv_bytes_per_token_layer=kv_bytes_per_token_layer(model),
        compute=measure_compute(model, repeats),
        tiers={label: measure_tier(tier, label, model, model_fingerprint) for label, tier in tiers.items()},
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def ensure_profile(model: LayerwiseModel, model_fingerprint: str, dtype: str, tiers: dict[str, KVStore]
                   ) -> MachineProfile:
    """The saved profile of this model and dtype, with every tier in `tiers` measured: what is missing (the
    whole profile, or a tier it never saw) is measured now and saved, so it is measured once per machine."""
    profile = load_profile(model_fingerprint, dtype)
    if profile is None:
        log.warning("no machine profile for model %s (%s): measuring one now; `kvreuse profile` refreshes it",
                    model_fingerprint, dtype)
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
