"""CacheFlow's pipeline-stage restoration: with S stages, each stage owns a contiguous layer range and restores
it on its own, concurrently with the other stages, starting from the prefix's stored boundary activations (the
hidden state entering its first layer) instead of waiting for the stage before it. Within a stage the same
two-pointer restoration runs over the stage's layers. Only the prompt's remainder then flows through the
pipeline, stage to stage, and the last stage produces the first token's logits.

Each stage is one process of a `torch.distributed` group (gloo on CPU, NCCL on GPUs: the hidden state sent
between stages lives on the model's device). `restore_stage` is what every rank of a serving deployment calls;
`spawn_stages` starts S local processes on loopback and gathers their results, for tests and benchmarks.
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from kvreuse.fusion.plan import Block
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore.job import HiddenSource
from kvreuse.restore.restorer import PrefixRestorer, RestoreResult, as_ids, restore_stats, stage_layers
from kvreuse.store import KeySpace, open_store
from kvreuse.store.base import KVStore


class MissingBoundary(RuntimeError):
    """A stage needs boundary activations the store does not hold (the prefix was stored for other stages)."""


@dataclass
class StageResult:
    layers: range
    cache: KVCache  # rows of the whole prompt; only this stage's layers are filled
    logits: torch.Tensor | None  # on the last stage only
    stats: dict = field(default_factory=dict)


def boundary_source(store: KVStore, blocks: list[Block], layer: int) -> HiddenSource:
    """Hidden states entering `layer` for prefix rows, read from the blocks' stored boundary activations."""

    def hidden_in(rows: slice) -> torch.Tensor:
        parts = []
        for block in blocks:
            local = block.overlap(rows)
            if local.stop <= local.start:
                continue
            meta = store.meta(block.key, with_extras=True)
            if meta is None or layer not in meta.boundary_layers:
                raise MissingBoundary(f"block {block.index} ({block.key}) has no boundary activations for layer "
                                      f"{layer}; store the prefix with boundary_stages covering this split")
            parts.append(meta.boundary[meta.boundary_layers.index(layer), local])
        return torch.cat(parts)

    return hidden_in


@torch.inference_mode()
def restore_stage(restorer: PrefixRestorer, token_ids: Sequence[int] | torch.Tensor, strategy: str = "auto",
                  cache_capacity: int | None = None) -> StageResult:
    """Restore this rank's layer range of the stored prefix of `token_ids`, then pass the remainder's hidden
    state down the pipeline. Every rank of the default process group calls this with the same arguments."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = restorer.model
    layers = stage_layers(model.num_layers, world)[rank]
    ids = as_ids(token_ids, model.device)
    blocks = restorer.blocks_to_restore(ids)
    hidden_in = boundary_source(restorer.store, blocks, layers.start) if layers.start else None
    job = restorer.new_job(ids, blocks, cache_capacity, layers=layers, hidden_in=hidden_in)
    strategy = restorer.strategy_for(strategy, blocks)
    axis, log = restorer.run_strategy(strategy, job)  # no communication: all stages at once

    rows = slice(job.prefix_length, len(ids))
    if rank == 0:
        hidden = model.embed(ids[rows])
    else:
        hidden = torch.empty(rows.stop - rows.start, model.hidden_size, dtype=model.dtype, device=model.device)
        dist.recv(hidden, src=rank - 1)
    hidden = job.compute_rows(rows, layers=layers, hidden=hidden)
    logits = None
    if rank + 1 < world:
        dist.send(hidden.contiguous(), dst=rank + 1)
    else:
        logits = model.logits(hidden[-1:])[0]
    return StageResult(layers, job.cache, logits, restore_stats(strategy, job, axis, log))


# ---- local launcher ----------------------------------------------------------------------------------------


@dataclass
class StageRun:
    """What every spawned stage process needs: picklable, so it crosses the process boundary."""

    hf_model: nn.Module
    store_spec: str  # a store every process can open: disk or Redis, not memory
    key_space: KeySpace
    block_size: int
    prompts: list[list[int]]
    strategies: list[str]  # one per prompt
    port: int
    out_dir: str
    threads: int = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stage_process(rank: int, world: int, run: StageRun) -> None:
    torch.set_num_threads(run.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo talks over loopback, never another interface
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{run.port}", rank=rank, world_size=world)
    store = open_store(run.store_spec)
    try:
        restorer = PrefixRestorer(LayerwiseModel(run.hf_model), store, run.key_space, run.block_size)
        results = []
        for prompt, strategy in zip(run.prompts, run.strategies):
            dist.barrier()  # stages start each prompt together, as they would on a request's arrival
            r = restore_stage(restorer, prompt, strategy)
            results.append({"layers": r.layers, "logits": r.logits, "stats": r.stats,
                            "k": [r.cache.keys[i][: len(prompt)] for i in r.layers],
                            "v": [r.cache.values[i][: len(prompt)] for i in r.layers]})
        torch.save(results, Path(run.out_dir) / f"stage{rank}.pt")
    finally:
        store.close()
        dist.destroy_process_group()


def spawn_stages(hf_model: nn.Module, store_spec: str, key_space: KeySpace, block_size: int,
                 prompts: list[list[int]], stages: int = 2, strategy: str | list[str] = "auto"
                 ) -> list[RestoreResult]:
    """Restore each prompt (with its strategy, or one for all) with `stages` local stage processes on loopback;
    returns each prompt's whole cache, assembled from the stages' layers, and the last stage's logits."""
    strategies = [strategy] * len(prompts) if isinstance(strategy, str) else list(strategy)
    with tempfile.TemporaryDirectory(prefix="kvreuse-stages-") as out_dir:
        run = StageRun(hf_model, store_spec, key_space, block_size, prompts, strategies, _free_port(), out_dir)
        mp.spawn(_stage_process, args=(stages, run), nprocs=stages, join=True)
        per_stage = [torch.load(Path(out_dir) / f"stage{s}.pt", weights_only=False) for s in range(stages)]
    model = LayerwiseModel(hf_model)
    return [_assemble(model, len(prompt), [stage[i] for stage in per_stage]) for i, prompt in enumerate(prompts)]


def _assemble(model: LayerwiseModel, length: int, stages: list[dict]) -> RestoreResult:
    cache = model.new_cache(length)
    cache.allocate(torch.arange(length))
    for stage in stages:
        for i, layer in enumerate(stage["layers"]):
            cache.write(layer, slice(0, length), stage["k"][i], stage["v"][i])
    return RestoreResult(stages[-1]["logits"], cache, {"stages": [s["stats"] for s in stages]})

