"""Predicted TTFT of a fusion plan on this machine, from its profile.

The executor's loader reads layer i+1 once layer i's stored rows are placed, while layer i computes; so the
prediction replays that pipeline layer by layer with the profiled costs: a layer starts when the previous one
has finished and its stored KV has arrived; placing its loaded rows lets the next read start. This is
CacheTune's roofline, sum over layers of max(recompute, load) + t_o, with the pipeline's start-up and the
CPU's row-count-dependent matmul rate kept in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvreuse.controller.profile import ComputeProfile, MachineProfile
from kvreuse.fusion.plan import FusionPlan


@dataclass(frozen=True)
class Prediction:
    seconds: float  # TTFT of the plan: request overhead plus the layer pipeline
    compute_seconds: float  # all layers' compute, as if nothing waited for loads
    load_seconds: float  # all layers' reads, as if nothing waited for compute


@dataclass(frozen=True)
class LayerWork:
    rows: int  # rows whose attention and MLP run
    qkv_rows: int  # rows whose q/k/v are projected (more than `rows` on a layer that narrows)
    pairs: int  # query-key pairs attention scores under the causal mask


def layer_work(plan: FusionPlan, num_layers: int) -> list[LayerWork]:
    """What each layer computes under `plan`. Where CacheBlend narrows, which rows survive depends on the KV,
    so the survivors are taken at the mean position of the narrowable rows."""
    approximate = torch.zeros(plan.num_rows, dtype=torch.bool)
    for span in plan.reused:
        approximate[span.start : span.start + span.length] = span.approximate
    approximate[-1] = False
    selected = plan.compute_rows
    exact_rows, narrowable = selected[~approximate[selected]], selected[approximate[selected]]
    exact_pairs = int((exact_rows + 1).sum())
    narrowable_count, narrowable_pairs = narrowable.numel(), int((narrowable + 1).sum())
    keeps = {n.layer: round(n.keep * plan.approximate_rows) for n in plan.narrowing}
    work = []
    for layer in range(num_layers):
        before = exact_rows.numel() + narrowable_count
        if layer in keeps and keeps[layer] < narrowable_count:
            mean_pair = narrowable_pairs / max(narrowable_count, 1)
            narrowable_count = keeps[layer]
            narrowable_pairs = round(mean_pair * narrowable_count)
        work.append(LayerWork(exact_rows.numel() + narrowable_count, before, exact_pairs + narrowable_pairs))
    return work


def predict(plan: FusionPlan, span_tiers: list[str], profile: MachineProfile) -> Prediction:
    """span_tiers[i]: the profiled tier that serves plan.reused[i] (ignored for spans that load nothing)."""
    if len(span_tiers) != len(plan.reused):
        raise ValueError(f"span_tiers: {len(span_tiers)} tiers for {len(plan.reused)} reused spans")
    unknown = sorted({t for t in span_tiers if t not in profile.tiers})
    if unknown:
        raise ValueError(f"span_tiers: no profile of tier {unknown[0]!r} (profiled: {', '.join(profile.tiers)})")
    compute = profile.compute
    bytes_per_row = profile.kv_bytes_per_token_layer
    loading = [(profile.tiers[t], s.load.numel()) for s, t in zip(plan.reused, span_tiers) if s.load.numel()]
    read = sum(tier.read_seconds(rows * bytes_per_row) for tier, rows in loading)  # the loader reads spans in turn
    place = sum(rows for _, rows in loading) * compute.place_seconds

    clock = loader_free = 0.0  # when compute is free; when the loader may read the next layer
    compute_total = 0.0
    for work in layer_work(plan, profile.num_layers):
        start = max(clock, loader_free + read) if loading else clock
        loader_free = start + place  # the next read starts once this layer's stored rows are placed
        seconds = place + _layer_compute(work, compute)
        clock = start + seconds
        compute_total += seconds
    total_load = read * profile.num_layers if loading else 0.0
    return Prediction(compute.request_seconds + clock, compute_total, total_load)


def _layer_compute(work: LayerWork, compute: ComputeProfile) -> float:
    # On a narrowing layer the projections ran for every row before the selection shrank.
    extra_qkv = compute.qkv_share * (compute.dense(work.qkv_rows) - compute.dense(work.rows))
    return compute.layer_seconds(work.rows, work.pairs) + extra_qkv
