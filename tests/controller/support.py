"""Synthetic machine profiles for the controller's tests: chosen costs, no model, no timing."""

from __future__ import annotations

import torch

from kvreuse.controller.profile import RUNTIME_REVISION, ComputeProfile, MachineProfile, TierProfile
from kvreuse.fusion.methods import parse_method
from kvreuse.fusion.plan import FusionPlan, PlacedSegment
from kvreuse.fusion.segments import Request, Segment, SegmentKind

KV_BYTES = 1536  # SmolLM2-135M in fp32: 3 KV heads x 64 dims x K and V x 4 bytes
LAYERS = 30
TIERS = {
    "memory": TierProfile("memory", bytes_per_second=10e9, latency_seconds=0.0),
    "ssd": TierProfile("ssd", bytes_per_second=1e9, latency_seconds=100e-6, emulated=True),
    "hdd": TierProfile("hdd", bytes_per_second=100e6, latency_seconds=10e-3, emulated=True),
}


def synthetic_profile(seconds_per_row: float, score_seconds: float = 0.0, place_seconds: float = 0.0,
                      tiers: dict[str, TierProfile] = TIERS, layers: int = LAYERS) -> MachineProfile:
    """A machine whose dense compute costs `seconds_per_row` per row per layer, attention `score_seconds` per
    query-key score, placing a loaded row `place_seconds`; nothing else costs anything."""
    compute = ComputeProfile(rows=[64, 2048], dense_seconds=[64 * seconds_per_row, 2048 * seconds_per_row],
                             score_seconds=score_seconds, key_seconds=0.0, call_seconds=0.0,
                             place_seconds=place_seconds, request_seconds=0.0, qkv_share=0.0)
    return MachineProfile(model="synthetic", dtype="float32", num_layers=layers, kv_bytes_per_token_layer=KV_BYTES,
                          compute=compute, tiers=tiers, runtime_revision=RUNTIME_REVISION)


def rag_request() -> Request:
    """A 4-token prefix, 5 chunks of 200 tokens, 20 fresh tokens (token ids are irrelevant to plans)."""
    return Request([Segment(SegmentKind.PREFIX, [1] * 4), *(Segment(SegmentKind.CHUNK, [2] * 200) for _ in range(5)),
                    Segment(SegmentKind.FRESH, [3] * 20)])


def rag_plan(method: str, tier: str, request: Request | None = None) -> tuple[FusionPlan, list[str]]:
    """The method's plan when every chunk is stored on `tier` (the prefix is not), and each span's tier."""
    request = request or rag_request()
    ranking = torch.Generator().manual_seed(0)
    placed = [PlacedSegment(s, f"chunk-{i}", True, torch.rand(200, generator=ranking))
              if s.kind == SegmentKind.CHUNK else PlacedSegment(s) for i, s in enumerate(request.segments)]
    plan = parse_method(method).plan(request, placed)
    return plan, [tier] * len(plan.reused)
