"""Pipeline-stage restoration: two stage processes (torch.distributed, gloo on loopback) each restore their
own layers from stored boundary activations, concurrently; together they give a full prefill's KV and logits."""

from __future__ import annotations

import pytest
import torch

from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore import PrefixRestorer
from kvreuse.restore.job import LayerAxis, TokenAxis
from kvreuse.restore.restorer import as_ids, stage_layers
from kvreuse.restore.stages import MissingBoundary, boundary_source, spawn_stages
from kvreuse.store import KeySpace, open_store

from .support import restore_split

TOLERANCE = dict(atol=1e-4, rtol=0)
BLOCK = 8
SPACE = KeySpace("tiny-model", "tiny-tok")


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.timeout(120)
def test_two_stages_restore_exactly(make_tiny, tmp_path):
    hf_model = make_tiny("qwen3")  # q/k norm: the stored key is the normalised one
    model = LayerwiseModel(hf_model)
    spec = f"disk:{tmp_path / 'store'}"
    store = open_store(spec)
    restorer = PrefixRestorer(model, store, SPACE, block_size=BLOCK, boundary_stages=(2,))
    # (prompt, stored prefix, strategy): one block, several, not whole blocks, the whole prompt, nothing.
    cases = [(45, 8, "cake"), (45, 40, "layerwise"), (45, 21, "cake"), (48, 48, "layerwise"), (45, 40, "load"),
             (20, 0, "cake")]
    prompts = []
    for i, (n, stored, _) in enumerate(cases):
        prompts.append(ids_of(n, seed=i))
        if stored:
            restorer.store_prefix(prompts[-1][:stored])
    store.close()
    results = spawn_stages(hf_model, spec, SPACE, BLOCK, prompts, 2, [c[2] for c in cases])
    for prompt, (n, stored, _), result in zip(prompts, cases, results):
        full = model.prefill(prompt)
        for layer in range(model.num_layers):
            for got, want in zip(result.cache.layer(layer), full.cache.layer(layer)):
                torch.testing.assert_close(got, want, **TOLERANCE)
        torch.testing.assert_close(result.logits, full.logits, **TOLERANCE)
        for stage in result.stats["stages"]:  # both stages restored the stored prefix themselves
            assert stage["prefix_tokens"] == min(stored // BLOCK * BLOCK, n - 1)


def test_a_stage_without_stored_boundaries_says_so(make_tiny):
    tiny_model = LayerwiseModel(make_tiny("llama"))
    restorer = PrefixRestorer(tiny_model, open_store("memory:64MB"), SPACE, block_size=BLOCK, boundary_stages=(2,))
    prompt = ids_of(30, seed=0)
    restorer.store_prefix(prompt)
    ids = as_ids(prompt, tiny_model.device)
    with pytest.raises(MissingBoundary, match="layer 2"):
        boundary_source(restorer.store, restorer.blocks_to_restore(ids), 2)(slice(0, 8))


@pytest.mark.parametrize("axis", [TokenAxis, LayerAxis])
def test_a_stage_from_its_boundary_is_exact_at_every_split_point(make_tiny, axis):
    """Stage 2 of 2 alone (no process group needed for the prefix part): its layers restored from the stored
    boundary activations, with positions [0, k) computed and the rest loaded, for every k."""
    model = LayerwiseModel(make_tiny("llama3-rope"))
    restorer = PrefixRestorer(model, open_store("memory:64MB"), SPACE, block_size=BLOCK, boundary_stages=(2,))
    prompt = ids_of(45, seed=3)
    restorer.store_prefix(prompt)
    ids = as_ids(prompt, model.device)
    blocks = restorer.blocks_to_restore(ids)
    layers = stage_layers(model.num_layers, 2)[1]
    full = model.prefill(prompt)
    with torch.inference_mode():
        for split in range(axis(restorer.new_job(ids, blocks, layers=layers)).length + 1):
            job = restorer.new_job(ids, blocks, layers=layers, hidden_in=boundary_source(restorer.store, blocks,
                                                                                         layers.start))
            restore_split(axis(job), split)
            for layer in layers:
                for got, want in zip(job.cache.layer(layer), full.cache.layer(layer)):
                    torch.testing.assert_close(got[: job.prefix_length], want[: job.prefix_length], **TOLERANCE)
