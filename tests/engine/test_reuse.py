"""ReuseEngine on tiny models: write-back off the critical path, lost entries, the loader thread, bad input."""

import re
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreuse.engine import reuse as reuse_module
from kvreuse.fusion.executor import INLINE_LAYERS_PER_READ, LayerLoader
from kvreuse.fusion.methods import parse_method
from kvreuse.fusion.segments import Request, Segment, SegmentKind
from kvreuse.store.disk import DiskTier
from kvreuse.store.entry import EntryMeta, KVEntry, dtype_name
from kvreuse.store.memory import MemoryTier
from kvreuse.store.spec import open_store
from kvreuse.store.tiered import TieredStore, tier_label

TOLERANCE = dict(atol=1e-4, rtol=0)


class SlowStore:
    """Wraps a store: reads sleep a little (a slow device), writes wait for `release` (a stuck device)."""

    def __init__(self, inner, read_delay: float = 0.0):
        self.inner, self.read_delay = inner, read_delay
        self.release = threading.Event()
        self.release.set()
        self.lost: set[str] = set()

    def get_layers(self, key, start, stop):
        time.sleep(self.read_delay)
        return None if key in self.lost else self.inner.get_layers(key, start, stop)

    def view_layers(self, key, start, stop):
        time.sleep(self.read_delay)
        return None if key in self.lost else self.inner.view_layers(key, start, stop)

    def get_rows(self, key, rows, layers=None):
        time.sleep(self.read_delay)
        return None if key in self.lost else self.inner.get_rows(key, rows, layers)

    def view_rows(self, key, rows, layers=None):
        time.sleep(self.read_delay)
        return None if key in self.lost else self.inner.view_rows(key, rows, layers)

    def view_layers_picking(self, key, start, stop):
        time.sleep(self.read_delay)
        return None if key in self.lost else self.inner.view_layers_picking(key, start, stop)

    def view_picking(self, key, rows, layers=None):
        time.sleep(self.read_delay)
        return None if key in self.lost else self.inner.view_picking(key, rows, layers)

    def put(self, entry, *, handed_over=False):
        self.release.wait()
        return self.inner.put(entry, handed_over=handed_over)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def slow_engine(tiny_model, make_engine):
    store = SlowStore(open_store("memory:256MB"))
    engine = make_engine(tiny_model, store)
    yield engine, store
    store.release.set()
    engine.close()


def test_a_chunk_larger_than_every_tier_is_compiled_once_and_said_once(tiny_model, make_engine, rag_request,
                                                                     monkeypatch, caplog):
    """Its entry is refused for its size: later requests compute its rows as before, but no write-back computes its
    entry again to be refused again (each logged a write error); the warning comes once. Chunks that fit are
    stored as always."""
    request = rag_request(chunks=(30, 32, 5))
    sized = make_engine(tiny_model, open_store("memory:64MB"))
    sized.compile(request)
    *big_keys, small_key = (p.key for p in sized.lookup(request, parse_method("naive")) if p.key is not None)
    tier = MemoryTier(sized.store.get(big_keys[0]).nbytes - 1)
    engine = make_engine(tiny_model, TieredStore([tier]))
    compiled = []
    compile_chunk = reuse_module.compile_chunk
    monkeypatch.setattr(reuse_module, "compile_chunk", lambda model, ids, key, *a: compiled.append(key)
                        or compile_chunk(model, ids, key, *a))
    for _ in range(3):
        engine.prefill(request, "naive")
        engine.wait_for_write_back()
    assert sorted(compiled) == sorted([*big_keys, small_key])
    assert tier.contains(small_key) and tier.stats()["write_errors"] == 0
    assert not any(tier.contains(key) for key in big_keys)
    assert caplog.text.count("more than any tier") == 1
    refusing = make_engine(tiny_model, TieredStore([MemoryTier(tier.policy.capacity)]))
    everything = make_engine(tiny_model, open_store("memory:64MB"))
    assert everything.compile(request) - refusing.compile(request) == len(big_keys)  # written: what was stored


def test_missed_chunks_are_computed_and_written_back_without_waiting(slow_engine, rag_request):
    engine, store = slow_engine
    request = rag_request()
    store.release.clear()  # every store write now blocks
    first = engine.prefill(request, "naive")  # all chunks miss: computed as fresh tokens, so exact
    torch.testing.assert_close(first.logits, engine.prefill(request, "full").logits, **TOLERANCE)
    assert first.stats.chunk_hits == 0
    store.release.set()
    engine.wait_for_write_back()
    second = engine.prefill(request, "naive")
    assert second.stats.chunk_hits == len(request.of_kind(SegmentKind.CHUNK))
    assert second.stats.fusion.loaded_tokens > 0


def test_entry_lost_after_lookup_is_recomputed(slow_engine, rag_request):
    engine, store = slow_engine
    request = rag_request()
    engine.compile(request, ["naive"])
    reference = engine.prefill(request, "naive")
    # the last chunk: within a sliding window of the question, so its recomputation shows in the logits
    lost_chunk = [p for p in engine.lookup(request, parse_method("naive")) if p.key and p.segment.start][-1]
    store.lost.add(lost_chunk.key)  # still listed by meta(), but every read of it fails
    out = engine.prefill(request, "naive")
    assert out.stats.chunk_hits == len(request.of_kind(SegmentKind.CHUNK)) - 1
    assert (out.logits - reference.logits).abs().max() > 0  # that chunk now sees its context


def test_reading_inline_or_on_a_slow_loader_thread_does_not_change_results(slow_engine, rag_request):
    engine, store = slow_engine
    request = rag_request()
    engine.compile(request, ["cacheblend", "cachetune"])
    for method in ["cacheblend:0.3", "cachetune:0.3", "naive"]:
        plan, _ = engine.plan_on_tiers(request, method)
        inline = engine.executor.run(plan, request.token_ids, overlap_loads=False)
        store.read_delay = 0.002
        threaded = engine.executor.run(plan, request.token_ids, overlap_loads=True)
        store.read_delay = 0.0
        assert torch.equal(inline.logits, threaded.logits), method
        assert (inline.stats.loads_overlapped, threaded.stats.loads_overlapped) == (False, True)
        # Beyond the request's own cache the executor holds one layer of stored KV reading ahead on its thread,
        # and the layers of one read inline (several per read: each read pays a call's cost), from the first
        # layer read (CacheBlend's chunks: layer 1)
        layers_read = engine.model.num_layers - min(span.reads_from for span in plan.reused)
        assert inline.stats.peak_stored_layers_held == min(INLINE_LAYERS_PER_READ, layers_read) > 1
        assert threaded.stats.peak_stored_layers_held == 1


@pytest.mark.parametrize("method", ["naive", "cacheblend:0.3", "legolink:2", "cachetune:0.5"])
def test_a_run_from_the_memory_tier_leaves_its_entries_as_they_were(tiny_model, make_engine, rag_request, method):
    """The executor places stored KV from the memory tier's own tensors (view_layers): it must never write them."""
    engine = make_engine(tiny_model, open_store("memory:64MB"))
    request = rag_request()
    engine.compile(request, [method])
    memory = engine.store.tiers[0]
    before = {key: (entry.k.clone(), entry.v.clone()) for key, entry in memory.entries.items()}
    engine.prefill(request, method)
    assert before and all(torch.equal(memory.entries[key].k, k) and torch.equal(memory.entries[key].v, v)
                          for key, (k, v) in before.items())


@pytest.mark.parametrize("method", ["naive", "legolink:2"])
def test_a_run_from_the_memory_tier_copies_no_stored_rows_it_only_places(tiny_model, make_engine, rag_request, method,
                                                                        monkeypatch):
    """Whole chunks, and chunks but their first tokens (LegoLink's), are consecutive rows: the memory tier lends
    them (view_layers, view_rows) and the placer copies them once, into the request's cache."""
    from kvreuse.store import memory

    copies = []
    take_rows = memory.take_rows
    monkeypatch.setattr(memory, "take_rows", lambda *args: copies.append(args) or take_rows(*args))
    engine = make_engine(tiny_model, open_store("memory:64MB"))
    request = rag_request()
    engine.compile(request, [method])
    result = engine.prefill(request, method)
    assert result.stats.fusion.loaded_tokens > 0 and copies == []


def test_an_inline_run_reads_each_stored_span_a_few_layers_at_a_time(tiny_model, make_engine, rag_request,
                                                                     monkeypatch):
    reads = []
    engine = make_engine(tiny_model, open_store("memory:64MB"))
    request = rag_request()
    engine.compile(request)
    for name in ("view_layers_picking", "view_picking"):
        read = getattr(engine.store, name)
        monkeypatch.setattr(engine.store, name, lambda *args, read=read: reads.append(args) or read(*args))
    plan, _ = engine.plan_on_tiers(request, "naive")
    expected = engine.executor.run(plan, request.token_ids, overlap_loads=True).logits
    per_layer = len(reads)
    reads.clear()
    assert torch.equal(engine.executor.run(plan, request.token_ids, overlap_loads=False).logits, expected)
    spans, layers = per_layer // tiny_model.num_layers, tiny_model.num_layers
    assert spans > 0 and per_layer == spans * layers and len(reads) == spans * -(-layers // INLINE_LAYERS_PER_READ)


def test_a_prefill_from_disk_reads_each_stored_span_once(tiny_model, make_engine, rag_request, monkeypatch,
                                                          tmp_path):
    """The disk tier reads whole spans (`reads_whole_spans`: its reads are views of mapped files, each paying a
    file's open and header): an inline prefill reads every layer of a span at once, with the same logits as a
    prefill reading a few layers at a time."""
    reads = []
    monkeypatch.setattr("kvreuse.fusion.executor.INLINE_LAYERS_PER_READ", 1)  # fewer than the tiny model's layers
    engine = make_engine(tiny_model, open_store(f"disk:{tmp_path}"))
    request = rag_request()
    engine.compile(request)
    engine.prefill(request, "naive")  # what it writes back (its prefix's blocks) stored before the reads counted
    engine.wait_for_write_back()
    engine.store.flush()
    for name in ("view_layers_picking", "view_picking"):
        read = getattr(engine.store, name)
        monkeypatch.setattr(engine.store, name, lambda *args, read=read: reads.append(args) or read(*args))
    whole = engine.prefill(request, "naive")
    spans = len({args[0] for args in reads})
    assert spans > 0 and len(reads) == spans
    monkeypatch.setattr(DiskTier, "reads_whole_spans", False)
    reads.clear()
    assert torch.equal(engine.prefill(request, "naive").logits, whole.logits)
    assert len(reads) == spans * tiny_model.num_layers > spans


@pytest.mark.parametrize("method", ["naive", "cacheblend:0.3"])
def test_an_inline_run_places_a_read_s_layers_in_one_call(tiny_model, make_engine, rag_request, monkeypatch, method):
    """Inline, the layers a read holds are placed in one call (a call and its checks a layer cost naive 7% of its
    time); a loader thread's reads are placed a layer at a time, as they arrive. Both give the same result."""
    placed = []
    engine = make_engine(tiny_model, open_store("memory:64MB"))
    request = rag_request()
    engine.compile(request, [method])
    place_layers = engine.model.place_layers
    monkeypatch.setattr(engine.model, "place_layers",
                        lambda cache, layers, *args: placed.append(layers) or place_layers(cache, layers, *args))
    plan, _ = engine.plan_on_tiers(request, method)
    threaded = engine.executor.run(plan, request.token_ids, overlap_loads=True)
    first = min(span.reads_from for span in plan.reused)
    assert placed == [range(layer, layer + 1) for layer in range(first, tiny_model.num_layers)]
    placed.clear()
    assert torch.equal(engine.executor.run(plan, request.token_ids, overlap_loads=False).logits, threaded.logits)
    assert placed == [range(layer, min(layer + INLINE_LAYERS_PER_READ, tiny_model.num_layers))
                      for layer in range(first, tiny_model.num_layers, INLINE_LAYERS_PER_READ)]
    assert len(placed[0]) > 1


def test_every_overlapped_run_reads_on_the_executor_s_one_loader_thread(tiny_model, make_engine, rag_request,
                                                                        monkeypatch):
    """The engine owns its threads: successive runs' loaders read on the executor's one I/O thread, which ends
    with the engine."""
    readers = set()
    read_layer = LayerLoader._read_layer

    def recording(loader, layer):
        readers.add(threading.current_thread())
        return read_layer(loader, layer)

    monkeypatch.setattr(LayerLoader, "_read_layer", recording)
    engine = make_engine(tiny_model, open_store("throttled:ssd:memory:64MB"))
    request = rag_request()
    engine.compile(request)
    for _ in range(3):
        assert engine.prefill(request, "naive").stats.fusion.loads_overlapped
    (reader,) = readers
    assert reader is not threading.main_thread() and reader.name.startswith("kv-loader")
    engine.close()
    reader.join(timeout=10)
    assert not reader.is_alive()


def test_only_reads_that_wait_on_a_device_get_a_loader_thread(tiny_model, make_engine, rag_request):
    request = rag_request()
    for spec, overlapped in [("memory:64MB", False), ("throttled:ssd:memory:64MB", True)]:
        engine = make_engine(tiny_model, open_store(spec))
        try:
            engine.compile(request)
            assert engine.prefill(request, "naive").stats.fusion.loads_overlapped is overlapped, spec
        finally:
            engine.close()


def test_prompt_longer_than_the_context_window_names_the_field(tiny_engine, rag_request):
    window = tiny_engine.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"chunks\[1\]: .* exceed the context window"):
        tiny_engine.prefill(rag_request(chunks=(10, window + 1)), "naive")
    with pytest.raises(ValueError, match="prompt: .* exceed the context window"):
        tiny_engine.prefill(rag_request(chunks=(window // 2, window // 2)), "naive")


def test_while_writes_are_behind_a_chunk_is_compiled_on_its_second_request(tiny_engine, rag_request):
    """A request's chunks are all written when the writes keep up; while others wait, a chunk sent once is
    remembered, and written when a request sends it again."""
    tiny_engine.write_back.between_steps()  # writes wait for run_one: the test decides when they run
    try:
        first, second = rag_request(prefix=0, chunks=(10, 12)), rag_request(prefix=0, chunks=(11, 13))
        tiny_engine.prefill(first, "naive")
        assert tiny_engine.write_back.pending == 2  # none waited before it: both of its chunks
        tiny_engine.prefill(second, "naive")
        assert tiny_engine.write_back.pending == 2 and tiny_engine.write_back.held_back == 2
        tiny_engine.prefill(second, "naive")
        assert tiny_engine.write_back.pending == 4
    finally:
        tiny_engine.write_back.in_background()
        tiny_engine.wait_for_write_back()
    assert all(p.hit for p in tiny_engine.lookup(second, parse_method("naive")) if p.key)


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_a_token_id_outside_the_vocabulary_is_named_before_any_work(tiny_engine, rag_request, bad):
    vocab_size = tiny_engine.model.config.vocab_size
    bad = vocab_size if bad == "vocab" else bad
    prefix, chunk, fresh = rag_request(chunks=(10,)).segments
    request = Request([prefix, Segment(SegmentKind.CHUNK, chunk.token_ids[:-1] + [bad]), fresh])
    message = rf"token id {bad} is outside the vocabulary \[0, {vocab_size}\)"
    for run in (lambda: tiny_engine.prefill(request, "naive"), lambda: tiny_engine.compile(request)):
        with pytest.raises(ValueError, match=message):
            run()
    assert list(tiny_engine.store.keys()) == []


def test_a_chunk_longer_than_the_window_is_not_compiled(tiny_engine, rag_request):
    """It could never be read: a prompt holding it does not fit."""
    window = tiny_engine.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"chunks\[0\]: .* exceed the context window"):
        tiny_engine.compile(rag_request(chunks=(window + 1,)))
    assert list(tiny_engine.store.keys()) == []


def test_a_chunk_the_request_holds_twice_is_compiled_once(tiny_engine, rag_request, monkeypatch):
    request = rag_request(chunks=(10, 12))
    prefix, first, second, fresh = request.segments
    twice = Request([prefix, first, second, Segment(SegmentKind.CHUNK, first.token_ids), fresh])
    compiled: list[str] = []
    compile_one = tiny_engine._compile
    monkeypatch.setattr(tiny_engine, "_compile", lambda segment, key, method: compiled.append(key)
                        or compile_one(segment, key, method))
    written = tiny_engine.compile(twice)
    assert len(compiled) == len(set(compiled)) == 2
    assert written == 3 and len(list(tiny_engine.store.keys())) == 3  # a prefix block and two chunks


def test_a_closed_engine_refuses_work_instead_of_queueing_writes_nobody_runs(tiny_model, make_engine, rag_request):
    engine = make_engine(tiny_model)
    request = rag_request()
    engine.prefill(request, "naive")
    engine.close()
    for work in (lambda: engine.prefill(request, "naive"), lambda: engine.compile(request)):
        with pytest.raises(RuntimeError, match="ReuseEngine is closed"):
            work()
    assert engine.write_back.pending == 0
    engine.close()  # a second close does nothing


def test_empty_segments_are_refused(rag_request):
    with pytest.raises(ValueError, match="empty chunk segment"):
        rag_request(chunks=(10, 0, 5))


def test_a_salted_request_shares_the_store_but_not_its_entries(tiny_engine, rag_request):
    request = rag_request()
    tiny_engine.compile(request, ["naive"])
    salted = Request(request.segments, salt="tenant-a")
    assert tiny_engine.prefill(salted, "naive").stats.chunk_hits == 0
    tiny_engine.wait_for_write_back()
    assert tiny_engine.prefill(salted, "naive").stats.chunk_hits == len(request.of_kind(SegmentKind.CHUNK))


def test_loaded_tokens_are_counted_by_the_tier_serving_them(tiny_model, make_engine, rag_request, tmp_path):
    engine = make_engine(tiny_model, open_store(f"memory:256MB,disk:{tmp_path}"))
    try:
        request = rag_request()
        engine.compile(request, ["naive"])
        engine.store.tiers[0].clear()  # only the disk tier holds the entries now
        stats = engine.prefill(request, "naive").stats
        chunk_rows = stats.fusion.loaded_tokens - stats.prefix.loaded_tokens  # the prefix's are counted apart
        assert stats.loaded_tokens_by_tier == {tier_label(engine.store, 1): chunk_rows}
    finally:
        engine.close()


def test_auto_runs_the_method_its_controller_chooses(tiny_model, rag_request, make_engine):
    """The engine resolves auto per request through its controller, and the result is that method's own."""
    from kvreuse.controller.auto import AutoController
    from kvreuse.controller.fidelity import Fidelity, FidelityTable
    from kvreuse.controller.profile import ComputeProfile, MachineProfile, TierProfile

    compute = ComputeProfile([64, 2048], [64e-5, 2048e-5], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    profile = MachineProfile("tiny-model", "float32", tiny_model.num_layers, 64, compute,
                             {"memory": TierProfile("memory", 1e10, 0.0)})
    table = FidelityTable("tiny-model", {"naive": Fidelity(0.4, 0.4), "cacheblend:0.3": Fidelity(0.05, 0.7)})
    engine = make_engine(tiny_model, controller=AutoController(profile, table))
    request = rag_request()
    engine.compile(request)
    try:
        chosen = engine.prefill(request, "auto")
        direct = engine.prefill(request, "cacheblend:0.3")
        loose = engine.prefill(request, "auto:kl=0.5")
    finally:
        engine.close()
    assert (chosen.stats.fusion.method, chosen.stats.auto.requested_method) == ("cacheblend:0.3", "auto")
    assert set(chosen.stats.auto.candidates) == {"cacheblend:0.3", "prefix"}
    assert chosen.stats.auto.predicted_ttft == chosen.stats.auto.candidates["cacheblend:0.3"]
    torch.testing.assert_close(chosen.logits, direct.logits, **TOLERANCE)
    assert loose.stats.fusion.method == "naive"


def test_cost_placement_keeps_new_chunks_out_of_memory_when_the_slow_tier_hides_their_reads(tiny_model, rag_request,
                                                                                               make_engine):
    from kvreuse.controller.auto import AutoController
    from kvreuse.controller.placement import PlacementPolicy
    from kvreuse.controller.profile import ComputeProfile, MachineProfile, TierProfile

    slow_compute = ComputeProfile([64, 2048], [1.0, 32.0], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # hides any read
    tiers = {"memory": TierProfile("memory", 1e10, 0.0), "hdd": TierProfile("hdd", 2e8, 8e-3, emulated=True)}
    profile = MachineProfile("tiny-model", "float32", tiny_model.num_layers, 64, slow_compute, tiers)
    store = open_store("memory:64MB,throttled:hdd:memory:64MB")
    engine = make_engine(tiny_model, store, controller=AutoController(profile, None), placement=PlacementPolicy())
    request = rag_request()
    try:
        engine.compile(request, ["cacheblend:0.15"])  # placed for CacheBlend's 15%, recomputed beside each read
        keys = [p.key for p in engine.lookup(request, parse_method("cacheblend:0.15")) if p.hit]
        assert keys and all(store.locate(k) == 1 and not store.tiers[0].contains(k) for k in keys)
        placed = engine.prefill(request, "cacheblend:0.15")
        chunk_rows = placed.stats.fusion.loaded_tokens - placed.stats.prefix.loaded_tokens
        assert placed.stats.loaded_tokens_by_tier == {"hdd": chunk_rows}
        store.flush()
        assert all(store.tiers[0].contains(k) for k in keys)  # a hit promotes them: hot entries live in memory
    finally:
        engine.close()


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(max_size=4096))
def test_any_bytes_in_place_of_a_stored_chunk_answer_as_if_it_were_not_stored(tiny_model, make_engine, rag_request,
                                                                             tmp_path_factory, garbage):
    engine = make_engine(tiny_model, open_store(f"disk:{tmp_path_factory.mktemp('damaged')}"))
    try:
        request = rag_request()
        engine.compile(request, ["naive"])
        damaged = [p for p in engine.lookup(request, parse_method("naive")) if p.key][-1]
        engine.store.delete(damaged.key)
        computed = engine.prefill(request, "naive")  # that chunk computed with the request
        engine.wait_for_write_back()
        engine.store.tiers[0]._write(damaged.key, garbage)
        out = engine.prefill(request, "naive")
        assert out.stats.chunk_hits == len(request.of_kind(SegmentKind.CHUNK)) - 1
        torch.testing.assert_close(out.logits, computed.logits, atol=1e-5, rtol=0)
    finally:
        engine.close()


@pytest.mark.parametrize("layers, tokens, heads, dtype", [
    (+1, 0, 0, torch.float32), (-1, 0, 0, torch.float32), (0, -1, 0, torch.float32), (0, 0, +1, torch.float32),
    (0, 0, 0, torch.bfloat16)])
def test_another_model_s_kv_under_a_chunk_s_key_answers_as_if_it_were_not_stored(tiny_model, make_engine, rag_request,
                                                                                layers, tokens, heads, dtype):
    """A writer's bug, or one store two models share under one fingerprint: an entry under a chunk's key whose
    layers, tokens, heads or dtype are not this model's is a miss (the look-up and the plan's read check it), never
    a failed request or KV of another shape placed."""
    engine = make_engine(tiny_model)
    try:
        request = rag_request()
        engine.compile(request, ["naive"])
        foreign = [p for p in engine.lookup(request, parse_method("naive")) if p.key][-1]
        ours = engine.store.get(foreign.key)
        engine.store.delete(foreign.key)
        computed = engine.prefill(request, "naive")  # that chunk computed with the request
        engine.wait_for_write_back()
        engine.store.delete(foreign.key)
        L, T, H, D = ours.k.shape
        shape = (L + layers, T + tokens, H + heads, D)
        meta = EntryMeta("tiny-model", dtype_name(dtype), shape[0], shape[1])
        assert engine.store.put(KVEntry(foreign.key, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), meta))
        out = engine.prefill(request, "naive")
        assert out.stats.chunk_hits == len(request.of_kind(SegmentKind.CHUNK)) - 1
        torch.testing.assert_close(out.logits, computed.logits, atol=1e-5, rtol=0)
    finally:
        engine.close()


@pytest.mark.parametrize("method, recomputed_share", [("naive", 0.0), ("cacheblend:0.5", 0.5), ("cacheblend:1.0", 1.0)])
def test_only_stored_rows_no_layer_recomputes_to_the_end_count_as_cached(tiny_engine, rag_request, method,
                                                                        recomputed_share):
    """OpenAI's cached_tokens: a chunk row CacheBlend recomputes through the last layer was loaded, not kept."""
    request = rag_request()
    tiny_engine.compile(request, [method])
    stats = tiny_engine.prefill(request, method).stats
    chunk_rows = sum(len(c.token_ids) for c in request.of_kind(SegmentKind.CHUNK))
    prefix_rows = len(request.of_kind(SegmentKind.PREFIX)[0].token_ids)  # stored whole: loaded, and kept
    assert stats.chunk_hits == len(request.of_kind(SegmentKind.CHUNK))
    assert stats.fusion.loaded_tokens == chunk_rows + prefix_rows
    assert stats.fusion.kept_tokens == chunk_rows - round(recomputed_share * chunk_rows)
    assert stats.cached_tokens == stats.fusion.kept_tokens + prefix_rows


def test_auto_s_candidates_share_one_store_probe_per_request(tiny_model, rag_request, make_engine):
    """Method auto prices several candidates; their lookups share the request's one probe of the store (each
    chunk key asked once) instead of asking per candidate, and no span is located with a second walk."""
    from kvreuse.controller.auto import AutoController
    from kvreuse.controller.fidelity import Fidelity, FidelityTable
    from kvreuse.controller.profile import ComputeProfile, MachineProfile, TierProfile

    compute = ComputeProfile([64, 2048], [64e-5, 2048e-5], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    profile = MachineProfile("tiny-model", "float32", tiny_model.num_layers, 64, compute,
                             {"memory": TierProfile("memory", 1e10, 0.0)})
    table = FidelityTable("tiny-model", {m: Fidelity(0.05, 0.7) for m in ("naive", "cacheblend:0.3", "legolink:16")})
    engine = make_engine(tiny_model, controller=AutoController(profile, table))
    request = rag_request()
    engine.compile(request)
    probes, inner, locate = [], engine.store.probe, engine.store.locate
    chunk_keys = {p.key for p in engine.lookup(request, parse_method("naive")) if p.key}
    engine.store.probe = lambda keys, extras=False: probes.append(list(keys)) or inner(keys, extras)
    # the restorer locates the prefix's blocks; a chunk located on its own would be a second walk
    engine.store.locate = lambda key: pytest.fail(f"chunk {key} located again") if key in chunk_keys else locate(key)
    try:
        out = engine.prefill(request, "auto")
    finally:
        del engine.store.probe, engine.store.locate
        engine.close()
    assert len(out.stats.auto.candidates) >= 3 and out.stats.chunk_hits == len(request.of_kind(SegmentKind.CHUNK))
    assert len(probes) == 1 and sorted(probes[0]) == sorted(chunk_keys)


def test_a_plan_counts_the_bytes_its_reads_fetched(tiny_model, make_engine, rag_request, tmp_path):
    """bytes_loaded is what the tier's backend fetched (headers, whole row groups), the tier's own count, and
    CacheTune's sparse read at r = 0.5 fetches less than naive's whole reads (on these short chunks, whole 16-row
    groups; tests/store/test_sparse_reads.py holds the share on 160- and 500-token chunks)."""
    engine = make_engine(tiny_model, open_store(f"disk:{tmp_path}"))
    try:
        request = rag_request()
        engine.compile(request, ["naive", "cachetune"])
        fetched = {}
        for method in ["naive", "cachetune:0.5"]:
            before = engine.store.stats()["tiers"][0]["bytes_read"]
            stats = engine.prefill(request, method).stats.fusion
            fetched[method] = engine.store.stats()["tiers"][0]["bytes_read"] - before
            assert stats.bytes_loaded == fetched[method], method
        assert fetched["cachetune:0.5"] < fetched["naive"]
    finally:
        engine.close()


@pytest.mark.parametrize("method", ["cacheblend:0.15", "guarded:1e-3"])
def test_a_method_recomputing_every_chunk_row_at_layer_0_does_not_read_their_stored_layer_0(
        tiny_model, make_engine, rag_request, method):
    """Its stored layer 0 would be overwritten unread: it reads the layers above, naive's bytes less one layer."""
    engine = make_engine(tiny_model)
    try:
        request = rag_request(prefix=0)
        engine.compile(request)
        fetched = {m: engine.prefill(request, m).stats.fusion.bytes_loaded for m in ("naive", method)}
        layers = tiny_model.num_layers
        assert fetched[method] * layers == fetched["naive"] * (layers - 1)
    finally:
        engine.close()


def test_an_engine_over_a_bare_tier_reuses_as_over_a_tiered_store(tiny_model, make_engine, rag_request):
    request, engine = rag_request(), make_engine(tiny_model, MemoryTier(64 << 20))
    engine.compile(request, ["naive"])
    engine.store.flush()
    reused = engine.prefill(request, "naive")
    assert reused.stats.chunk_hits == len(request.of_kind(SegmentKind.CHUNK))
    engine.close()


@pytest.mark.parametrize("call, message", [
    (lambda e: e.build_request("one document", "Q?"), "chunks: expected a list of texts, got str"),
    (lambda e: e.build_request([123], "Q?"), "chunks: expected a list of texts"),
    (lambda e: e.build_request((d for d in ["doc"]), "Q?"), "chunks: expected a list of texts, got generator"),
    (lambda e: e.build_request({"doc": 1}, "Q?"), "chunks: expected a list of texts, got dict"),
    (lambda e: e.build_request(["doc"], None), "question: expected text, got NoneType"),
    (lambda e: e.build_request(["doc"], "Q?", system=123), "system: expected text, got int"),
    (lambda e: e.prefill(e.build_request(["doc"], "Q?"), 5), "method: expected a method name"),
    (lambda e: e.compile(e.build_request(["doc"], "Q?"), "cacheblend:0.15"), "methods: expected a list"),
    (lambda e: e.build_request(["doc"], "Q?", history=5), "history: expected a list of messages, got int 5"),
    (lambda e: e.ask(["doc"], "Q?", history="hi"), "history: expected a list of messages, got str"),
    (lambda e: e.build_request(["doc"], "Q?", salt=5), "salt: expected text, got int 5"),
    (lambda e: e.prefill("Q?"), "request: expected a Request (build_request makes one), got str 'Q?'"),
    (lambda e: e.compile("Q?"), "request: expected a Request"),
    (lambda e: e.generate(e.build_request(["doc"], "Q?"), sampling={"max_tokens": 4}),
     "sampling: expected SamplingParams, got dict"),
])
def test_arguments_of_the_wrong_type_are_named(tiny_chat_engine, call, message):
    """A string where a list of documents goes made one chunk per character, silently; an iterator, a request
    without its chunks (used up by the check)."""
    with pytest.raises(TypeError, match=re.escape(message)):
        call(tiny_chat_engine)


def test_a_store_spec_that_is_not_text_is_named():
    with pytest.raises(TypeError, match="store spec: expected text"):
        open_store(None)


def test_lookup_takes_a_method_by_name(tiny_engine, rag_request):
    request = rag_request()
    assert [p.key for p in tiny_engine.lookup(request, "naive")] == [
        p.key for p in tiny_engine.lookup(request, parse_method("naive"))]
