"""ReuseEngine restores a request's exact prefix block by block (any strategy, any stored length) and fuses the
chunks and fresh tokens on top of it; newly computed prefix blocks are stored in the background, so a
conversation whose history grows reuses its longest stored prefix."""

from __future__ import annotations

import pytest
import torch

from kvreuse.fusion.executor import INLINE_LAYERS_PER_READ, FusionExecutor, LayerLoader
from kvreuse.fusion.methods import parse_method
from kvreuse.fusion.plan import PrefixSplit
from kvreuse.fusion.segments import Request, Segment, SegmentKind
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore import STRATEGIES
from kvreuse.restore.job import PrefixJob
from kvreuse.restore.restorer import StepCosts
from kvreuse.store.spec import open_store

from ..conftest import make_tiny_engine, random_ids

TOLERANCE = dict(atol=1e-4, rtol=0)
BLOCK = 4


def conversation(prefix_tokens: int, chunk_tokens: int = 13, fresh_tokens: int = 5) -> Request:
    """A prefix that grows with the conversation (the same tokens, more of them), one chunk, a new question."""
    history = random_ids(64, seed=11)[:prefix_tokens]
    return Request([Segment(SegmentKind.PREFIX, history), Segment(SegmentKind.CHUNK, random_ids(chunk_tokens, 12)),
                    Segment(SegmentKind.FRESH, random_ids(fresh_tokens, 13))])


@pytest.fixture
def engine(make_tiny):
    engine = make_tiny_engine(LayerwiseModel(make_tiny("qwen3")), prefix_block_size=BLOCK)
    yield engine
    engine.close()


def full_prefill(engine, request: Request):
    return engine.model.prefill(request.token_ids)


@pytest.mark.parametrize("strategy", ["auto", *STRATEGIES])
def test_the_restored_prefix_with_chunks_computed_on_top_is_exact(tiny_model, strategy):
    engine = make_tiny_engine(tiny_model, prefix_block_size=BLOCK, prefix_strategy=strategy)
    try:
        request = conversation(prefix_tokens=23)
        engine.compile(request, ["prefix"])
        out = engine.prefill(request, "prefix", extra_capacity=3)
        assert out.stats.prefix.restored_tokens == 23  # 5 whole blocks and the partial one that ends the prefix
        restored = out.stats.prefix.loaded_tokens + out.stats.prefix.recomputed_tokens
        assert restored == pytest.approx(23)
        full = full_prefill(engine, request)
        torch.testing.assert_close(out.logits, full.logits, **TOLERANCE)
        for layer in range(engine.model.num_layers):
            for got, want in zip(out.cache.layer(layer), full.cache.layer(layer)):
                torch.testing.assert_close(got, want, **TOLERANCE)
        next_id = int(full.logits.argmax())  # decoding goes on from the cache
        torch.testing.assert_close(engine.model.decode(next_id, out.cache), engine.model.decode(next_id, full.cache),
                                   **TOLERANCE)
    finally:
        engine.close()


def test_a_growing_conversation_reuses_its_longest_stored_prefix(engine):
    first = engine.prefill(conversation(prefix_tokens=10), "prefix")
    assert first.stats.prefix.restored_tokens == 0
    engine.wait_for_write_back()  # the first turn's two whole blocks are now stored, and its partial last one
    later = conversation(prefix_tokens=30)  # the history grew by a turn: that partial block is not one of its
    out = engine.prefill(later, "prefix")
    assert out.stats.prefix.restored_tokens == 8
    assert out.stats.prefix.seconds > 0
    torch.testing.assert_close(out.logits, full_prefill(engine, later).logits, **TOLERANCE)
    engine.wait_for_write_back()
    assert engine.prefill(later, "prefix").stats.prefix.restored_tokens == 30


def test_a_prefix_shorter_than_a_block_is_stored_whole_and_restored_exactly(tiny_model):
    """A system prompt under a block (SmolLM2's chat template head is 24 tokens) is stored as one partial block
    after the first request, then loaded by every request that starts with it, and only by those: its key names
    every one of its tokens."""
    engine = make_tiny_engine(tiny_model, prefix_block_size=16, prefix_strategy="load")
    try:
        request = conversation(prefix_tokens=10)
        assert engine.prefill(request, "prefix").stats.prefix.restored_tokens == 0
        engine.wait_for_write_back()
        out = engine.prefill(request, "prefix", extra_capacity=2)
        assert out.stats.prefix.restored_tokens == 10 and out.stats.prefix.loaded_tokens == 10
        assert out.stats.fusion.computed_tokens_layer0 == len(request) - 10
        full = full_prefill(engine, request)
        torch.testing.assert_close(out.logits, full.logits, **TOLERANCE)
        for layer in range(engine.model.num_layers):
            for got, want in zip(out.cache.layer(layer), full.cache.layer(layer)):
                torch.testing.assert_close(got, want, **TOLERANCE)
        head = request.segments[0].token_ids
        for other in (head[:-1] + [head[-1] + 1], head[:9], head + [7]):  # its last token, one fewer, one more
            changed = Request([Segment(SegmentKind.PREFIX, other), *request.segments[1:]])
            assert engine.prefill(changed, "prefix").stats.prefix.restored_tokens == 0
    finally:
        engine.close()


def test_a_prefix_s_partial_last_block_follows_its_whole_ones(engine):
    request = conversation(prefix_tokens=18)  # 4 whole blocks of 4, then 2 tokens
    engine.compile(request, ["prefix"])
    restorer = engine.restorer_for(request)
    keys = restorer.block_keys(request.token_ids[:18], partial=True)
    assert len(keys) == 5 and all(engine.store.contains(k) for k in keys)
    blocks = restorer.blocks_to_restore(request.token_ids, max_tokens=18)
    assert [(b.key, b.rows, b.stored_tokens) for b in blocks][-2:] == [(keys[3], slice(12, 16), 4),
                                                                      (keys[4], slice(16, 18), 2)]
    # without the prefix's length, only whole blocks: where the prompt's own tokens end no prefix does
    assert [b.key for b in restorer.blocks_to_restore(request.token_ids)] == keys[:4]
    engine.store.delete(keys[2])  # a gap: what follows it is not a prefix of this prompt any more
    assert [b.key for b in restorer.blocks_to_restore(request.token_ids, max_tokens=18)] == keys[:2]


def test_only_a_prefix_under_a_block_is_written_back_for_its_partial_block_alone(engine, monkeypatch):
    """A longer prefix's partial block is stored beside its whole blocks' write-back, never by a write-back of its
    own: a conversation growing turn by turn does no more background work than its whole blocks did."""
    long, short = conversation(prefix_tokens=18), conversation(prefix_tokens=3)  # blocks of 4
    for request in (long, short):
        engine.compile(request, ["prefix"])
        prefix = request.segments[0].token_ids
        engine.store.delete(engine.restorer_for(request).block_keys(prefix, partial=True)[-1])  # its partial block
    submitted = []
    monkeypatch.setattr(engine.write_back, "submit", lambda key, write, **_: submitted.append(key))
    assert engine.prefill(long, "prefix").stats.prefix.restored_tokens == 16 and submitted == []
    assert engine.prefill(short, "prefix").stats.prefix.restored_tokens == 0 and len(submitted) == 1


def test_two_prefixes_sharing_their_whole_blocks_each_write_back_their_partial_block(engine, monkeypatch):
    """Their write-backs were de-duplicated by the last whole block's key: while the first was pending, the
    second prefix's partial block was dropped, and its requests recomputed it for good."""
    first = conversation(prefix_tokens=18)  # 4 whole blocks of 4, then 2 tokens
    head = first.segments[0].token_ids
    second = Request([Segment(SegmentKind.PREFIX, head[:16] + [t + 1 for t in head[16:]]), *first.segments[1:]])
    writes = {}
    monkeypatch.setattr(engine.write_back, "submit", lambda key, write, **_: writes.setdefault(key, write))
    for request in (first, second):
        engine.prefill(request, "prefix")
    ends = [engine.restorer_for(r).block_keys(r.segments[0].token_ids, partial=True)[-1] for r in (first, second)]
    assert set(ends) <= set(writes) and len(set(ends)) == 2
    for write in writes.values():  # the prefixes' and the chunk's
        write()
    assert engine.prefill(first, "prefix").stats.prefix.restored_tokens == 18
    assert engine.prefill(second, "prefix").stats.prefix.restored_tokens == 18


def test_chunk_fusion_on_a_restored_prefix_equals_it_on_a_computed_one(engine):
    request = conversation(prefix_tokens=18)
    engine.compile(request, ["naive"])  # chunk compiled alone: naive reuse is approximate, the same either way
    restored = engine.prefill(request, "naive")
    assert restored.stats.prefix.restored_tokens == 18 and restored.stats.chunk_hits == 1
    computed = make_tiny_engine(engine.model, engine.store, prefix_block_size=64).prefill(request, "naive")
    assert computed.stats.prefix.restored_tokens == 0 and computed.stats.chunk_hits == 1
    torch.testing.assert_close(restored.logits, computed.logits, **TOLERANCE)


def test_full_recomputes_the_prefix_too(engine):
    request = conversation(prefix_tokens=18)
    engine.compile(request, ["full"])
    assert engine.prefill(request, "full").stats.prefix.strategy is None


def test_a_prefix_block_lost_after_lookup_is_recomputed_exactly(engine):
    from .test_reuse import SlowStore

    store = SlowStore(engine.store)
    lossy = make_tiny_engine(engine.model, store, prefix_block_size=BLOCK, prefix_strategy="load")
    request = conversation(prefix_tokens=18)
    lossy.compile(request, ["prefix"])
    store.lost.add(lossy.restorer_for(request).block_keys(request.token_ids)[2])
    out = lossy.prefill(request, "prefix")
    assert out.stats.prefix.restored_tokens == 18
    assert out.stats.prefix.recomputed_tokens_by_tier == {"memory": 4}
    torch.testing.assert_close(out.logits, full_prefill(lossy, request).logits, **TOLERANCE)


def test_a_plan_with_restored_rows_needs_their_cache(engine):
    request = conversation(prefix_tokens=18)
    engine.compile(request, ["prefix"])
    restoration = engine.restorer_for(request).restore_prefix(request.token_ids, "load", len(request), max_tokens=18)
    placed = engine.lookup(request, parse_method("prefix"), restored=restoration.rows)
    plan = parse_method("prefix").plan(request, placed)
    assert plan.restored_rows == 18 and int(plan.compute_rows[0]) == 18
    with pytest.raises(ValueError, match="restored"):
        FusionExecutor(engine.model, engine.store).run(plan, request.token_ids)


def test_unknown_prefix_strategy_is_an_error(make_tiny):
    with pytest.raises(ValueError, match="prefix_strategy"):
        make_tiny_engine(LayerwiseModel(make_tiny("qwen3")), prefix_strategy="fastest")


@pytest.mark.real_model
def test_earlier_turns_extend_the_exact_prefix(embedded_model):
    """With the real chat template, the next turn's prefix starts with this turn's: its blocks stay reusable."""
    from kvreuse.fusion.segments import build_request

    turns = [{"role": "user", "content": "What is a KV cache?"},
             {"role": "assistant", "content": "The keys and values attention keeps for past tokens."}]
    more = turns + [{"role": "user", "content": "Why store it?"}, {"role": "assistant", "content": "To reuse it."}]
    tokenizer = embedded_model.tokenizer
    now = build_request(tokenizer, ["a chunk"], "Next?", "Be brief.", history=turns).segments[0]
    later = build_request(tokenizer, ["a chunk"], "Next?", "Be brief.", history=more).segments[0]
    assert now.kind == later.kind == SegmentKind.PREFIX
    assert len(later.token_ids) > len(now.token_ids) and later.token_ids[: len(now.token_ids)] == now.token_ids
    with pytest.raises(ValueError, match="history"):
        build_request(tokenizer, ["a chunk"], "Next?", history=[{"role": "user"}])


def shared_prefix_requests(n: int) -> list[Request]:
    """n requests on one stored conversation prefix of different lengths, each with its own chunk and question."""
    history = random_ids(64, seed=11)
    return [Request([Segment(SegmentKind.PREFIX, history[: 17 + 6 * i]),
                     Segment(SegmentKind.CHUNK, random_ids(13, 20 + i)),
                     Segment(SegmentKind.FRESH, random_ids(5, 30 + i))]) for i in range(n)]


@pytest.mark.parametrize("strategy", ["auto", "cake", "layerwise"])
@pytest.mark.parametrize("method", ["prefix", "cacheblend:0.3"])
def test_prefixes_restored_together_equal_each_request_prefilled_alone(tiny_model, strategy, method):
    """CacheFlow's batch-aware restoration serving requests: their stored prefixes come back in one batch, then
    each plan runs on top; every output equals the same request prefilled alone (and, for the exact method, a
    full prefill)."""
    engine = make_tiny_engine(tiny_model, prefix_block_size=BLOCK, prefix_strategy=strategy, batch_restore="on")
    try:
        requests = shared_prefix_requests(4)
        engine.compile(requests[-1], [method])  # the longest prefix's blocks, and every chunk
        for request in requests:
            engine.compile(request, [method])
        batch = list(engine.prefill_batch([(r, method, 4) for r in requests]))
        for request, out in zip(requests, batch):
            assert out.stats.prefix.batch == 4
            assert out.stats.prefix.restored_tokens == len(request.segments[0].token_ids)
            alone = engine.prefill(request, method, extra_capacity=4)
            assert alone.stats.prefix.batch == 1
            torch.testing.assert_close(out.logits, alone.logits, **TOLERANCE)
            if method == "prefix":
                torch.testing.assert_close(out.logits, full_prefill(engine, request).logits, **TOLERANCE)
            next_id = int(out.logits.argmax())  # decoding goes on from the batch's cache
            torch.testing.assert_close(engine.model.decode(next_id, out.cache),
                                       engine.model.decode(next_id, alone.cache), **TOLERANCE)
    finally:
        engine.close()


@pytest.mark.parametrize("store, together", [("memory:64MB", False), ("throttled:net10g:memory:64MB", True)])
def test_auto_restores_together_only_when_a_tier_s_reads_wait(make_tiny, store, together):
    """Where every read is CPU work (memory), restoring together only delays the first requests (RESULTS.md);
    over a tier whose reads wait, the loads of one request overlap the others' compute, as CacheFlow's do."""
    from kvreuse.store.spec import open_store

    engine = make_tiny_engine(LayerwiseModel(make_tiny("llama")), open_store(store), prefix_block_size=BLOCK)
    try:
        requests = shared_prefix_requests(3)
        for request in requests:
            engine.compile(request, ["prefix"])
        batch = list(engine.prefill_batch([(r, "prefix", 4) for r in requests]))
        assert [out.stats.prefix.batch for out in batch] == [3 if together else 1] * 3
        for request, out in zip(requests, batch):
            torch.testing.assert_close(out.logits, full_prefill(engine, request).logits, **TOLERANCE)
    finally:
        engine.close()


def test_batch_restore_is_on_off_or_auto(tiny_model):
    with pytest.raises(ValueError, match="batch_restore: expected one of auto, on, off, got 'sometimes'"):
        make_tiny_engine(tiny_model, batch_restore="sometimes")


def test_a_batch_with_one_stored_prefix_restores_it_alone_and_a_bad_request_fails_alone(tiny_model):
    engine = make_tiny_engine(tiny_model, prefix_block_size=BLOCK, batch_restore="on")
    try:
        stored, fresh = shared_prefix_requests(2)
        engine.compile(stored, ["prefix"])
        fresh = Request([Segment(SegmentKind.PREFIX, random_ids(9, 40)), *fresh.segments[1:]])
        too_long = (stored, "prefix", 10**6)
        out = list(engine.prefill_batch([(stored, "prefix", 4), too_long, (fresh, "prefix", 4)]))
        assert out[0].stats.prefix.batch == 1 and out[0].stats.prefix.restored_tokens == 17
        assert isinstance(out[1], ValueError) and "context window" in str(out[1])
        assert out[2].stats.prefix.restored_tokens == 0
    finally:
        engine.close()


@pytest.mark.parametrize("computed_rows, computed_layers", [(0, 0), (3, 0), (9, 0), (20, 0), (0, 1), (0, 2)])
def test_every_split_of_the_stored_prefix_inside_the_plan_is_exact(tiny_model, computed_rows, computed_layers):
    """Whatever rows (token-wise) or layers (layer-wise) of the stored blocks the restorer computes, the plan that
    loads the rest beside a chunk equals a full prefill; a layer-wise split's rows leave the computation where
    their stored layers start."""
    engine = make_tiny_engine(tiny_model, prefix_block_size=BLOCK)
    try:
        request = conversation(prefix_tokens=23)
        engine.compile(request, ["naive"])
        blocks = engine.restorer_for(request).blocks_to_restore(request.token_ids, max_tokens=23)
        computed_layers = min(computed_layers, tiny_model.num_layers - 1)
        split = PrefixSplit("cake", blocks, computed_rows=computed_rows, computed_layers=computed_layers)
        plan = parse_method("prefix").plan(request, engine.lookup(request, parse_method("prefix"), split=split))
        assert sum(s.load.numel() for s in plan.reused) == 23 - computed_rows
        assert {s.from_layer for s in plan.reused} <= {computed_layers}
        out = engine.executor.run(plan, request.token_ids)
        rows, layers = len(request), engine.model.num_layers
        loaded = 23 - computed_rows
        computed = computed_layers * rows + (layers - computed_layers) * (rows - 23) if computed_layers else (
            layers * (rows - loaded))
        assert out.stats.computed_rows_mean == pytest.approx(computed / layers)
        full = full_prefill(engine, request)
        torch.testing.assert_close(out.logits, full.logits, **TOLERANCE)
        for layer in range(engine.model.num_layers):
            for got, want in zip(out.cache.layer(layer), full.cache.layer(layer)):
                torch.testing.assert_close(got, want, **TOLERANCE)
    finally:
        engine.close()


def test_a_stored_prefix_and_stored_chunks_load_through_one_loader(engine, monkeypatch):
    """One loader reads both, a few layers at a time (inline, from memory): every read holds the prefix's blocks
    and the chunk, and nothing else reads the store's prefix blocks."""
    request = conversation(prefix_tokens=18)
    engine.compile(request, ["naive"])
    loaders, reads = [], []
    real_init, real_read = LayerLoader.__init__, LayerLoader._read

    def counting_init(self, *args, **kwargs):
        loaders.append(self)
        real_init(self, *args, **kwargs)

    def recording_read(self, index, span, layer):
        reads.append((layer, span.key))
        return real_read(self, index, span, layer)

    monkeypatch.setattr(LayerLoader, "__init__", counting_init)
    monkeypatch.setattr(LayerLoader, "_read", recording_read)
    monkeypatch.setattr(PrefixJob, "read", lambda *a: pytest.fail("a prefix block read beside the plan's loader"))
    out = engine.prefill(request, "naive")
    blocks = engine.restorer_for(request).block_keys(request.token_ids[:18], partial=True)  # 4 whole, 1 partial
    chunk = engine.key_of(request, request.segments[1], parse_method("naive"))
    assert len(loaders) == 1
    firsts = range(0, engine.model.num_layers, INLINE_LAYERS_PER_READ)
    assert reads == [(layer, key) for layer in firsts for key in [*blocks, chunk]]
    assert out.stats.prefix.restored_tokens == 18 and out.stats.prefix.loaded_tokens == 18
    assert out.stats.chunk_hits == 1 and out.stats.cached_tokens == 18 + 13
    naive = parse_method("naive")
    prefix_computed = engine.executor.run(naive.plan(request, engine.lookup(request, naive)), request.token_ids)
    torch.testing.assert_close(out.logits, prefix_computed.logits, **TOLERANCE)


@pytest.mark.parametrize("strategy", ["cake", "layerwise"])
def test_the_restorer_computes_part_of_the_prefix_when_its_reads_are_slow(make_tiny, strategy):
    """With costs that make reading a stored row slower than computing it, and reads that overlap the compute, the
    restorer's split computes part of the prefix (rows for cake, layers for layerwise); the result stays exact
    and the stats say what was loaded and computed."""
    engine = make_tiny_engine(LayerwiseModel(make_tiny("llama")), open_store("throttled:ssd:memory:64MB"),
                              prefix_block_size=BLOCK, prefix_strategy=strategy)
    try:
        request = conversation(prefix_tokens=23)
        engine.compile(request, ["prefix"])
        engine._restore_rates["step", 0] = StepCosts(compute=1e-3, read=2e-3)
        split = engine.split_prefix(request)
        assert (split.computed_rows, split.computed_layers) != (0, 0) and split.strategy == strategy
        out = engine.prefill(request, "prefix")
        prefix = out.stats.prefix
        assert prefix.restored_tokens == 23 and prefix.recomputed_tokens > 0 and prefix.loaded_tokens > 0
        assert prefix.loaded_tokens + prefix.recomputed_tokens == 23
        torch.testing.assert_close(out.logits, full_prefill(engine, request).logits, **TOLERANCE)
        assert engine._restore_rates["step", 0] != StepCosts(compute=1e-3, read=2e-3)  # it learnt from the run
    finally:
        engine.close()


@pytest.mark.parametrize("strategy, costs", [("cake", None), ("layerwise", StepCosts(compute=1e-3, read=2e-3))])
def test_blocks_on_a_tier_whose_reads_pay_a_seek_are_read_whole(make_tiny, strategy, costs):
    """Where every read pays a device's latency (the emulated HDD's 8 ms), each block is read once, all its layers
    at once, instead of once per layer; layer-wise, from its first stored layer on. The result stays exact."""
    engine = make_tiny_engine(LayerwiseModel(make_tiny("llama")), open_store("throttled:hdd:memory:64MB"),
                              prefix_block_size=BLOCK, prefix_strategy=strategy)
    try:
        request = conversation(prefix_tokens=23)
        engine.compile(request, ["prefix"])
        if costs is not None:
            engine._restore_rates["step", 0] = costs
        split = engine.split_prefix(request)
        assert split.read_whole and (strategy == "cake" or split.computed_layers > 0)
        reads = []
        view_layers = engine.store.view_layers_picking
        engine.store.view_layers_picking = lambda key, start, stop: (reads.append((key, start, stop))
                                                                     or view_layers(key, start, stop))
        out = engine.prefill(request, "prefix")
        layers = engine.model.num_layers
        assert sorted(reads) == sorted((b.key, split.computed_layers, layers) for b in split.blocks)
        torch.testing.assert_close(out.logits, full_prefill(engine, request).logits, **TOLERANCE)
    finally:
        engine.close()


def test_before_any_plan_the_split_is_priced_by_the_machine_profile(make_tiny):
    """The restorer's costs start from the profile the controller prices plans with (one machine profile): a
    profile whose SSD reads a row slower than the CPU computes it has cake compute part of the prefix at once."""
    from kvreuse.controller.auto import AutoController
    from kvreuse.controller.fidelity import FidelityTable
    from kvreuse.controller.profile import ComputeProfile, MachineProfile, TierProfile

    model = LayerwiseModel(make_tiny("llama"))
    compute = ComputeProfile([64, 2048], [64e-6, 2048e-6], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # 1 us per row and layer
    kv_bytes = 1000
    profile = MachineProfile("tiny-model", "float32", model.num_layers, kv_bytes, compute,
                             {"ssd": TierProfile("ssd", kv_bytes / 3e-6, 0.0)})  # 3 us per row and layer
    engine = make_tiny_engine(model, open_store("throttled:ssd:memory:64MB"), prefix_block_size=BLOCK,
                              prefix_strategy="cake", controller=AutoController(profile, FidelityTable("tiny-model", {})))
    try:
        request = conversation(prefix_tokens=23)
        engine.compile(request, ["prefix"])
        split = engine.split_prefix(request)
        assert 0 < split.computed_rows < 20
        torch.testing.assert_close(engine.prefill(request, "prefix").logits, full_prefill(engine, request).logits,
                                   **TOLERANCE)
    finally:
        engine.close()
