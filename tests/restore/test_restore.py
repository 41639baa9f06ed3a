"""Exactness of prefix restoration: every strategy and every compute/load split gives a full prefill's KV and
next-token logits (fp32, within 1e-4), on tiny random-weight models of every family and on SmolLM2."""

from __future__ import annotations

import threading

import pytest
import torch

from kvreuse.restore import STRATEGIES, PrefixRestorer
from kvreuse.restore.job import LayerAxis, TokenAxis
from kvreuse.restore.restorer import as_ids
from kvreuse.restore.units import Rates
from kvreuse.store import KeySpace, open_store

from .support import Evicting, restore_split

TOLERANCE = dict(atol=1e-4, rtol=0)
BLOCK = 8
SPACE = KeySpace("tiny-model", "tiny-tok")


def ids_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_matches_full(model, result, token_ids) -> None:
    full = model.prefill(token_ids)
    n = len(token_ids)
    assert torch.equal(result.cache.positions, torch.arange(n))
    for layer in range(model.num_layers):
        for got, want in zip(result.cache.layer(layer), full.cache.layer(layer)):
            torch.testing.assert_close(got[:n], want[:n], **TOLERANCE)
    torch.testing.assert_close(result.logits, full.logits, **TOLERANCE)


def restorer_with(model, stored: list[int], store=None, **kwargs) -> PrefixRestorer:
    restorer = PrefixRestorer(model, store or open_store("memory:64MB"), SPACE, block_size=BLOCK, **kwargs)
    if stored:
        restorer.store_prefix(stored)
    return restorer


def test_what_store_prefix_stored_is_found_when_it_returns(tiny_model, tmp_path):
    """A disk tier behind a tiered store writes in the background: store_prefix waits for its blocks."""
    ids = ids_of(4 * BLOCK + 3, seed=5)
    restorer = PrefixRestorer(tiny_model, open_store(f"throttled:ssd:disk:{tmp_path}"), SPACE, block_size=BLOCK)
    assert restorer.store_prefix(ids) == 5
    assert restorer.stored_length(ids) == 4 * BLOCK
    assert len(restorer.stored_blocks(ids)) == 4
    restorer.store.close()


# prompt length, stored prefix length: a prefix of one block, several, not a whole number of blocks (the
# trailing part is computed), the whole prompt (its last token is computed all the same), and nothing stored.
CASES = [(45, 8), (45, 40), (45, 21), (48, 48), (45, 45), (20, 0)]


@pytest.mark.parametrize("prompt,stored", CASES)
@pytest.mark.parametrize("strategy", [*STRATEGIES, "auto"])
def test_every_strategy_gives_full_prefill(tiny_model, strategy, prompt, stored):
    token_ids = ids_of(prompt)
    restorer = restorer_with(tiny_model, token_ids[:stored])
    assert restorer.stored_length(token_ids) == stored // BLOCK * BLOCK
    result = restorer.restore(token_ids, strategy, cache_capacity=prompt + 4)
    assert_matches_full(tiny_model, result, token_ids)
    assert result.stats["prefix_tokens"] == min(stored // BLOCK * BLOCK, prompt - 1)
    # The restored cache decodes on: the next step matches decoding after a full prefill.
    full = tiny_model.prefill(token_ids)
    next_id = int(full.logits.argmax())
    torch.testing.assert_close(tiny_model.decode(next_id, result.cache), tiny_model.decode(next_id, full.cache),
                               **TOLERANCE)


@pytest.mark.parametrize("axis", [TokenAxis, LayerAxis])
def test_every_split_point_gives_full_prefill(tiny_model, axis):
    """Positions [0, k) computed and [k, n) loaded, for every k, inside blocks too: wherever the pointers meet
    the result is exact."""
    token_ids = ids_of(45)
    restorer = restorer_with(tiny_model, token_ids)
    ids = as_ids(token_ids, tiny_model.device)
    with torch.inference_mode():
        for split in range(axis(restorer.new_job(ids, restorer.blocks_to_restore(ids))).length + 1):
            job = restorer.new_job(ids, restorer.blocks_to_restore(ids))
            restore_split(axis(job), split)
            hidden = job.compute_rows(slice(job.prefix_length, len(ids)))
            result = type("R", (), {"cache": job.cache, "logits": tiny_model.logits(hidden[-1:])[0]})
            assert_matches_full(tiny_model, result, token_ids)


@pytest.mark.parametrize("strategy", ["load", "layerwise"])
def test_whole_blocks_are_read_as_the_memory_tier_s_own_tensors_and_left_as_they_were(tiny_model, strategy,
                                                                                         monkeypatch):
    token_ids = ids_of(45)
    restorer = restorer_with(tiny_model, token_ids[:40])
    memory = restorer.store.tiers[0]
    before = {key: (entry.k.clone(), entry.v.clone()) for key, entry in memory.entries.items()}
    views = []
    view_layers = restorer.store.view_layers_picking
    monkeypatch.setattr(restorer.store, "view_layers_picking",
                        lambda *args: views.append(args) or view_layers(*args))
    assert_matches_full(tiny_model, restorer.restore(token_ids, strategy, cache_capacity=50), token_ids)
    assert views and before and all(torch.equal(memory.entries[key].k, k) and torch.equal(memory.entries[key].v, v)
                                    for key, (k, v) in before.items())


def test_write_back_stores_the_computed_blocks(tiny_model):
    token_ids = ids_of(45)
    restorer = restorer_with(tiny_model, token_ids[:16])
    result = restorer.restore(token_ids, "cake", write_back=True)
    assert result.stats["blocks_written"] == 3  # blocks 2, 3, 4; the partial block 5 is never stored
    restorer.store.flush()
    assert restorer.stored_length(token_ids) == 40
    assert_matches_full(tiny_model, restorer.restore(token_ids, "load"), token_ids)


def test_stored_blocks_carry_their_boundary_activations(tiny_model):
    restorer = restorer_with(tiny_model, ids_of(16), boundary_stages=(2, 3))
    assert restorer.boundary_layers == [1, 2]
    meta = restorer.store.meta(restorer.block_keys(ids_of(16))[1], with_extras=True)
    assert meta.boundary_layers == [1, 2] and tuple(meta.boundary.shape) == (2, BLOCK, tiny_model.hidden_size)


def test_stored_blocks_carry_no_boundary_unless_asked(tiny_model):
    # One process restores every layer from the embeddings: a boundary would be bytes no reader ever reads.
    restorer = restorer_with(tiny_model, ids_of(16))
    assert restorer.boundary_layers == []
    meta = restorer.store.meta(restorer.block_keys(ids_of(16))[1], with_extras=True)
    assert meta.boundary is None and meta.boundary_layers == []


@pytest.mark.parametrize("strategy", ["load", "cake", "layerwise"])
def test_a_block_lost_mid_restoration_is_recomputed(tiny_model, strategy):
    token_ids = ids_of(45)
    store = Evicting(open_store("memory:64MB").tiers)
    restorer = restorer_with(tiny_model, token_ids, store)
    store.lost = {restorer.block_keys(token_ids)[-1]}  # the back: the first the I/O side asks for
    result = restorer.restore(token_ids, strategy)
    assert result.stats["spans_failed"], "the lost block was never asked for"
    assert_matches_full(tiny_model, result, token_ids)


@pytest.mark.parametrize("strategy", ["load", "layerwise"])
def test_a_corrupt_block_on_disk_is_recomputed(tiny_model, tmp_path, strategy):
    token_ids = ids_of(45)
    restorer = restorer_with(tiny_model, token_ids, open_store(f"disk:{tmp_path}"))
    disk = restorer.store.tiers[0]
    path = disk.path(restorer.block_keys(token_ids)[-1])  # the back: the first the I/O side asks for
    path.write_bytes(path.read_bytes()[:200])  # truncated: the header no longer matches the data
    result = restorer.restore(token_ids, strategy)
    assert result.stats["spans_failed"]
    assert_matches_full(tiny_model, result, token_ids)


def test_unknown_strategy_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="unknown strategy"):
        restorer_with(tiny_model, []).restore(ids_of(10), "fastest")


@pytest.mark.real_model
@pytest.mark.parametrize("strategy", ["cake", "layerwise"])
def test_real_model_restores_exactly(embedded_model, strategy):
    model = embedded_model.runtime
    token_ids = embedded_model.tokenizer("Restoring a stored prefix must give exactly the KV that a full "
                                         "prefill gives, whichever part was loaded and whichever computed.").input_ids
    restorer = PrefixRestorer(model, open_store("memory:256MB"), KeySpace(embedded_model.fingerprint, "tok"),
                              block_size=8)
    restorer.store_prefix(token_ids[:-3])
    result = restorer.restore(token_ids, strategy)
    assert result.stats["prefix_tokens"] >= 16
    assert_matches_full(model, result, token_ids)


def test_only_two_pointer_restorations_teach_the_rates(tiny_model):
    """Load-only and compute-only are baselines: what they measure (compute-only's rate covers the slow back of
    the prefix, which a two-pointer restoration never computes) must not size a later Cake's claims."""
    restorer = PrefixRestorer(tiny_model, open_store("memory:64MB"), KeySpace("tiny", "tok"), block_size=8)
    ids = torch.randint(3, 256, (50,), generator=torch.Generator().manual_seed(7)).tolist()
    restorer.store_prefix(ids)
    for strategy in ("load", "compute"):
        restorer.restore(ids, strategy)
        assert restorer._rates == {}
    restorer.restore(ids, "cake")  # which sides finish a span on so short a prefix is up to the threads
    assert restorer._rates[("TokenAxis", 0)] != Rates()


@pytest.mark.parametrize("strategy", ["load", "compute"])
def test_a_restoration_with_one_side_runs_on_the_caller_s_thread(tiny_model, monkeypatch, strategy):
    """Load-only and compute-only have nothing to overlap: no thread is started for them (the engine's prefix
    write-back is a load-only restoration, run between the scheduler's steps on its thread)."""
    restorer = PrefixRestorer(tiny_model, open_store("memory:64MB"), SPACE, block_size=BLOCK)
    ids = ids_of(40, seed=3)
    restorer.store_prefix(ids)
    started = []
    monkeypatch.setattr(threading.Thread, "start", lambda thread: started.append(thread.name))
    assert_matches_full(tiny_model, restorer.restore(ids, strategy), ids)
    assert started == []
