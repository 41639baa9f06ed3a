"""`kvreuse bench ttft`: TTFT of every reuse method x store tier x prompt length x number of chunks, with
Hugging Face transformers and vLLM measured on the same prompts in the same run.

    kvreuse bench ttft --dataset ../shared/datasets/hotpotqa.jsonl --out results/ttft

Each prompt's chunks are compiled into every tier first (not timed, as in the papers). Then every variant (each
tier x method, `full` once since it loads nothing, the transformers peer) runs once as a warm-up and `repeats`
times in turns. vLLM runs afterwards in its own process and venv on the same token ids. Every figure is also
given as a ratio to kvreuse's `full` on the same prompts, and each method's TTFT against its limit (DESIGN.md,
"Speed"; see timing.limit_seconds).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.progress import Progress

from kvreuse.bench.peers.transformers_peer import transformers_variants
from kvreuse.bench.peers import PEERS
from kvreuse.bench.peers.vllm_peer import MODES, VllmSettings, default_venv, run_vllm, unavailable_reason
from kvreuse.bench.tiers import open_engines
from kvreuse.bench.timing import NO_TIER, time_request
from kvreuse.bench.workload import Shape, TextSource, Workload, build_workload
from kvreuse.engine.reuse import ReuseEngine
from kvreuse.fusion.methods import DEFAULT_METHOD, parse_method
from kvreuse.model.loader import LoadedModel, load_model

DEFAULT_METHODS = f"full,naive,{DEFAULT_METHOD},cacheblend:0.15,legolink:16,cachetune:0.15"  # the server's default first
DEFAULT_TIERS = "memory,disk,redis,ssd,hdd,net10g"


@dataclass(frozen=True)
class TtftSettings:
    methods: list[str]
    tiers: list[str]
    lengths: list[int]
    chunks: list[int]
    prompts: int  # distinct prompts per (length, chunks)
    repeats: int
    dataset: str | None
    model: str | None
    peers: list[str]
    redis_url: str | None = None  # None: start a private redis-server when the redis tier is asked for
    vllm_venv: Path = field(default_factory=default_venv)
    dtype: str = "float32"  # kvreuse's, and the one vLLM is asked for


@dataclass
class Cell:
    """Everything measured for one (shape, tier, variant), over all prompts of the shape and repeats."""

    engine: str  # kvreuse, transformers or vllm
    seconds: list[float] = field(default_factory=list)
    limits: list[float] = field(default_factory=list)  # kvreuse methods only: one per prompt
    recompute_shares: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)  # vLLM: prompt tokens served from its prefix cache


CellKey = tuple[Shape, str, str]  # shape, tier, variant


def engine_of(variant: str) -> str:
    """Peers' variants are named `PEER:how` (transformers:prefix); everything else is a kvreuse method."""
    name = variant.partition(":")[0]
    return name if name in PEERS else "kvreuse"


def _forget(engine: ReuseEngine, workload: Workload, methods: list[str]) -> None:
    """Drop the workload's entries, so the tiers hold one prompt's chunks at a time (8K-token prompts are big)."""
    for method in {parse_method(m).compile_mode: parse_method(m) for m in methods}.values():
        for placed in engine.lookup(workload.request, method):
            if placed.hit:
                engine.store.delete(placed.key)


def _measure_workload(engines: dict[str, ReuseEngine], loaded: LoadedModel, workload: Workload,
                      settings: TtftSettings, cells: dict[CellKey, Cell]) -> None:
    peer = transformers_variants(loaded.runtime.hf_model, workload) if "transformers" in settings.peers else {}
    timings = time_request(engines, workload.request, settings.methods, settings.repeats, peer)
    for (tier, variant), sample in timings.samples.items():
        cell = cells.setdefault((workload.shape, tier, variant), Cell(engine_of(variant)))
        cell.seconds += sample.seconds
        if (tier, variant) in timings.limits:
            cell.limits.append(timings.limits[tier, variant])
            cell.recompute_shares.append(sample.last.stats.fusion.recompute_share)
    for engine in engines.values():
        _forget(engine, workload, settings.methods)


def _measure_vllm(loaded: LoadedModel, workloads: dict[str, Workload], settings: TtftSettings,
                  cells: dict[CellKey, Cell]) -> dict:
    vllm = VllmSettings(settings.vllm_venv, loaded.path, loaded.runtime.config.max_position_embeddings,
                        threads=torch.get_num_threads(), dtype=settings.dtype)
    reason = unavailable_reason(vllm)
    if reason:
        print(f"peer vllm skipped: {reason}")
        return {"skipped": reason}
    info = {}
    for variant, mode in MODES.items():
        print(f"peer vllm: {mode} prefill of {len(workloads)} prompts in {vllm.venv} ...")
        try:
            timings = run_vllm(vllm, mode, workloads, settings.repeats)
        except RuntimeError as e:  # the peer failing must not cost the kvreuse and transformers figures
            print(f"peer vllm failed: {e}")
            return {**info, "failed": str(e)}
        info[variant] = {"startup_seconds": timings.startup_seconds}
        info["version"] = timings.version
        for key, workload in workloads.items():
            cell = cells.setdefault((workload.shape, NO_TIER, variant), Cell("vllm"))
            cell.seconds += timings.seconds[key]
            cell.cached_tokens += timings.cached_tokens[key]
    return info


def measure(settings: TtftSettings) -> dict:
    """Run the grid; returns the raw measurements (cells) and what they were measured on."""
    started = time.perf_counter()
    loaded = load_model(settings.model, settings.dtype)
    window = loaded.runtime.config.max_position_embeddings
    source = TextSource(settings.dataset)
    shapes = [Shape(tokens, chunks) for tokens in settings.lengths for chunks in settings.chunks]
    workloads = {f"{s.tokens}x{s.chunks}#{i}": build_workload(loaded.tokenizer, source, s, i, window)
                 for s in shapes for i in range(settings.prompts)}
    cells: dict[CellKey, Cell] = {}
    with contextlib.ExitStack() as stack, torch.inference_mode(), Progress(transient=True) as progress:
        engines, specs = open_engines(loaded, settings.tiers, stack, settings.dtype, settings.redis_url)
        task = progress.add_task("kvreuse and transformers", total=len(workloads))
        for workload in workloads.values():
            _measure_workload(engines, loaded, workload, settings, cells)
            progress.advance(task)
    peers = {"vllm": _measure_vllm(loaded, workloads, settings, cells)} if "vllm" in settings.peers else {}
    prompt_tokens = defaultdict(list)
    for workload in workloads.values():
        prompt_tokens[workload.shape].append(len(workload.request))
    return {"model": loaded.name, "source": source.name, "cells": cells, "prompt_tokens": dict(prompt_tokens),
            "peers": peers, "duration_seconds": time.perf_counter() - started,
            "settings": {**asdict(settings), "vllm_venv": str(settings.vllm_venv)},
            "tier_specs": specs}
