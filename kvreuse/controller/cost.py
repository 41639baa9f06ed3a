"""Predicted TTFT of a fusion plan on this machine, from its profile.

The executor's loader reads layer i+1 once layer i's stored rows are placed, while layer i computes; so the
prediction replays that pipeline layer by layer with the profiled costs: a layer starts when the previous one
has finished and its stored KV has arrived; placing its loaded rows lets the next read start. Reads from
tiers that do not wait (CPU-bound: memory, page-cached disk) run inline, before their layer's compute. This is
CacheTune's roofline, sum over layers of max(recompute, load) + t_o, with the pipeline's start-up and the
CPU's row-count-dependent matmul rate kept in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvreuse.controller.profile import ComputeProfile, MachineProfile
from kvreuse.fusion.plan import FusionPlan
from kvreuse.model.attention import AttentionCall, attention_calls


@dataclass(frozen=True)
class Prediction:
    seconds: float  # TTFT of the plan: request overhead plus the layer pipeline
    compute_seconds: float  # all layers' compute, as if nothing waited for loads
    load_seconds: float  # all layers' reads, as if nothing waited for compute


@dataclass(frozen=True)
class LayerWork:
    rows: torch.Tensor  # positions of the rows whose attention and MLP run, sorted
    qkv_rows: int  # rows whose q/k/v are projected (more than `rows` on a layer that narrows)


def layer_work(plan: FusionPlan, num_layers: int) -> list[LayerWork]:
    """What each layer computes under `plan`; layers that compute the same rows share one LayerWork. Where
    CacheBlend narrows, which rows survive depends on the KV, so the survivors are taken evenly spread over the
    rows that could be dropped. Rows of a prefix restored layer-wise stop computing where their stored layers
    start."""
    narrowable_mask = plan.narrowable_mask
    selected = plan.compute_rows
    exact, narrowable = selected[~narrowable_mask[selected]], selected[narrowable_mask[selected]]
    keeps = {n.layer: n.kept_rows(plan.approximate_rows) for n in plan.narrowing}
    leaving = plan.leaving_rows()
    work = LayerWork(selected, selected.numel())
    layers = []
    for layer in range(num_layers):
        if layer in leaving:
            gone = leaving[layer]
            exact = exact[~torch.isin(exact, gone)]
            work = LayerWork(work.rows[~torch.isin(work.rows, gone)], work.rows.numel())
        if layer in keeps and keeps[layer] < narrowable.numel():
            before = work.rows.numel()
            narrowable = narrowable[torch.linspace(0, narrowable.numel() - 1, keeps[layer]).long()]
            work = LayerWork(torch.cat([exact, narrowable]).sort().values, before)
        elif work.qkv_rows != work.rows.numel():
            work = LayerWork(work.rows, work.rows.numel())
        layers.append(work)
    return layers


def predict(plan: FusionPlan, span_tiers: list[str], profile: MachineProfile) -> Prediction:
    """span_tiers[i]: the profiled tier that serves plan.reused[i] (ignored for spans that load nothing)."""
    if len(span_tiers) != len(plan.reused):
        raise ValueError(f"span_tiers: {len(span_tiers)} tiers for {len(plan.reused)} reused spans")
    unknown = sorted({t for t in span_tiers if t not in profile.tiers})
    if unknown:
        raise ValueError(f"span_tiers: no profile of tier {unknown[0]!r} (profiled: {', '.join(profile.tiers)})")
    compute = profile.compute
    bytes_per_row = profile.kv_bytes_per_token_layer
    loading = [(profile.tiers[t], s.load.numel(), s.reads_from) for s, t in zip(plan.reused, span_tiers)
               if s.load.numel()]

    def read_and_place(layer: int) -> tuple[float, float]:
        """Seconds reading the spans loaded on `layer` (the loader reads them in turn), and placing them."""
        on = [(tier, rows) for tier, rows, first in loading if first <= layer]
        return (sum(tier.read_seconds(rows * bytes_per_row) for tier, rows in on),
                sum(rows for _, rows in on) * compute.place_seconds)

    overlapped = any(tier.reads_wait for tier, _, _ in loading)  # else each layer reads inline, before computing

    clock = loader_free = 0.0  # when compute is free; when the loader may read the next layer
    compute_total = 0.0
    key_positions = torch.arange(plan.num_rows)
    seconds_of: dict[int, float] = {}  # layers computing the same rows cost the same
    total_load = 0.0
    for layer, work in enumerate(layer_work(plan, profile.num_layers)):
        window = profile.windows[layer] if profile.windows else None
        key = (id(work), window)
        if key not in seconds_of:
            seconds_of[key] = _layer_compute(work, attention_calls(work.rows, key_positions, window), compute)
        read, place = read_and_place(layer)
        if overlapped:
            start = max(clock, loader_free + read)
            loader_free = start + place  # the next read starts once this layer's stored rows are placed
        else:
            start = clock + read
        clock = start + place + seconds_of[key]
        compute_total += place + seconds_of[key]
        total_load += read
    return Prediction(compute.request_seconds + clock, compute_total, total_load)


def _layer_compute(work: LayerWork, attention: list[AttentionCall], compute: ComputeProfile) -> float:
    rows = work.rows.numel()
    # On a narrowing layer the projections ran for every row before the selection shrank.
    extra_qkv = compute.qkv_share * (compute.dense(work.qkv_rows) - compute.dense(rows))
    return compute.layer_seconds(rows, attention) + extra_qkv
