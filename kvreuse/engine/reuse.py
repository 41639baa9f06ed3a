"""ReuseEngine: the Python API a RAG developer uses.

    engine = ReuseEngine.load()                                   # embedded model, in-memory store
    out = engine.ask(chunks=docs, question=q, method="cacheblend:0.15")
    print(out.text, out.ttft, out.stats)                          # stats: tokens loaded/recomputed, seconds

or, step by step: `request = engine.build_request(...)`, `engine.compile(request)` to warm the store ahead of
time, `engine.generate(request, method)`.

A request's chunks are looked up in the store; the method turns hits and misses into a plan; one executor runs
it. Chunks that missed are computed with the request and compiled for next time in the background: a request
never waits for a store write.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvreuse.engine.generate import Generation, decode
from kvreuse.engine.sampling import SamplingParams
from kvreuse.fusion.compile import compile_chunk
from kvreuse.fusion.executor import FusionExecutor, FusionResult, StoredKVMissing
from kvreuse.fusion.methods import Method, parse_method
from kvreuse.fusion.plan import FusionPlan, PlacedSegment
from kvreuse.fusion.segments import Request, Segment, SegmentKind, build_request
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.loader import LoadedModel, load_model
from kvreuse.store.base import KVStore
from kvreuse.store.keys import KeySpace, chunk_key
from kvreuse.store.spec import open_store

log = logging.getLogger(__name__)
DEFAULT_STORE = "memory:4GB"


@dataclass
class FusedPrefill:
    logits: torch.Tensor  # [vocab]: first-token logits
    cache: KVCache  # the request's own KV cache, ready for decoding
    ttft: float  # seconds: lookup, load and compute up to the first-token logits
    stats: dict


class ReuseEngine:
    def __init__(self, loaded: LoadedModel, store: KVStore, salt: str | None = None):
        self.loaded, self.store, self.salt = loaded, store, salt
        self.model = loaded.runtime
        self.executor = FusionExecutor(self.model, store)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-compile")
        self._pending: dict[str, Future] = {}

    @classmethod
    def load(cls, model: str | None = None, store: str = DEFAULT_STORE, dtype: str = "float32",
             salt: str | None = None) -> ReuseEngine:
        loaded = load_model(model, dtype)
        return cls(loaded, open_store(store, model_fingerprint=loaded.fingerprint, dtype=dtype), salt)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    def with_salt(self, salt: str | None) -> ReuseEngine:
        """This engine keying the store under `salt` (a tenant's own entries); model, store and write-back are
        shared with it."""
        view = copy.copy(self)
        view.salt = salt
        return view

    def build_request(self, chunks: list[str], question: str, system: str | None = None) -> Request:
        return build_request(self.tokenizer, chunks, question, system)

    # ---- store lookups and compilation ----------------------------------------------------------------

    def key_of(self, segment: Segment, method: Method) -> str:
        # The exact prefix is always compiled plainly at offset 0, which is where it sits: its KV is exact.
        mode = method.compile_mode if segment.kind == SegmentKind.CHUNK else "plain"
        space = KeySpace(self.loaded.fingerprint, self.loaded.tokenizer_fingerprint, self.salt, mode)
        return chunk_key(segment.token_ids, space)

    def lookup(self, request: Request, method: Method, lost: frozenset[str] | set[str] = frozenset()) -> list[PlacedSegment]:
        """Each segment of `request` with its store key and whether the store holds it (keys in `lost` are
        treated as misses: entries found unreadable during this request)."""
        placed = []
        for segment in request.segments:
            if segment.kind == SegmentKind.FRESH:
                placed.append(PlacedSegment(segment))
                continue
            key = self.key_of(segment, method)
            meta = None if key in lost else self.store.meta(key, with_extras=method.needs_ranking)
            placed.append(PlacedSegment(segment, key, meta is not None, None if meta is None else meta.ranking))
        return placed

    def _compile(self, segment: Segment, key: str, method: Method) -> None:
        dummies = int(method.compile_mode.partition(":")[2] or 0) if segment.kind == SegmentKind.CHUNK else 0
        dummy_id = self.model.config.bos_token_id or 0
        self.store.put(compile_chunk(self.model, segment.token_ids, key, self.fingerprint, dummies, dummy_id))

    def compile(self, request: Request, methods: list[str] | None = None) -> int:
        """Compile and store every prefix and chunk of `request` that the store lacks, in each compile mode the
        methods need; returns how many entries were written. Waits until they are readable."""
        written = 0
        for method in {parse_method(m).compile_mode: parse_method(m) for m in methods or [None]}.values():
            for p in self.lookup(request, method):
                if p.key is not None and not p.hit:
                    self._compile(p.segment, p.key, method)
                    written += 1
        self.store.flush()
        return written

    def _write_back(self, placed: list[PlacedSegment], method: Method) -> None:
        for p in placed:
            if p.key is not None and not p.hit and p.key not in self._pending:
                self._pending[p.key] = self._writer.submit(self._compile, p.segment, p.key, method)
                self._pending[p.key].add_done_callback(lambda _, key=p.key: self._pending.pop(key, None))

    def wait_for_write_back(self) -> None:
        for future in list(self._pending.values()):
            future.result()
        self.store.flush()

    # ---- requests --------------------------------------------------------------------------------------

    def check_fits(self, request: Request, extra_tokens: int = 0) -> None:
        window = self.model.config.max_position_embeddings
        for i, chunk in enumerate(request.of_kind(SegmentKind.CHUNK)):
            if len(chunk.token_ids) > window:
                raise ValueError(f"chunks[{i}]: {len(chunk.token_ids)} tokens exceed the context window of {window}")
        if len(request) + extra_tokens > window:
            raise ValueError(
                f"prompt: {len(request)} tokens (+{extra_tokens} to generate) exceed the context window of {window}"
            )

    def prefill(self, request: Request, method: str | None = None, extra_capacity: int = 0) -> FusedPrefill:
        policy = parse_method(method)
        self.check_fits(request, extra_capacity)
        started = time.perf_counter()
        lost: set[str] = set()
        while True:
            placed = self.lookup(request, policy, lost)
            plan = policy.plan(request, placed)
            loaded_by_tier = self._loaded_tokens_by_tier(plan)
            try:
                result: FusionResult = self.executor.run(plan, request.token_ids, extra_capacity)
                break
            except StoredKVMissing as e:  # evicted or damaged since the lookup: compute it instead
                log.warning("%s; recomputing it", e)
                lost.add(e.key)
        self._write_back(placed, policy)
        stats = dict(result.stats, chunk_hits=sum(p.hit for p in placed if p.segment.kind == SegmentKind.CHUNK),
                     chunks=len(request.of_kind(SegmentKind.CHUNK)), loaded_tokens_by_tier=loaded_by_tier)
        return FusedPrefill(result.logits, result.cache, time.perf_counter() - started, stats)

    def _loaded_tokens_by_tier(self, plan: FusionPlan) -> dict[str, int]:
        """Tokens each tier serves to `plan`, located before the run (a read promotes what it reads)."""
        tiers = getattr(self.store, "tiers", [self.store])
        by_tier: Counter[str] = Counter()
        for span in plan.reused:
            index = self.store.locate(span.key) if len(tiers) > 1 else 0
            if index is not None and span.load.numel():
                by_tier[tiers[index].name] += int(span.load.numel())
        return dict(by_tier)

    def generate(self, request: Request, method: str | None = None, sampling: SamplingParams | None = None
                 ) -> Generation:
        sampling = sampling or SamplingParams()
        started = time.perf_counter()
        fused = self.prefill(request, method, extra_capacity=sampling.max_tokens)
        generation = decode(self.loaded, fused.logits, fused.cache, sampling, started, len(request))
        generation.stats = fused.stats
        return generation

    def ask(self, chunks: list[str], question: str, system: str | None = None, method: str | None = None,
            max_tokens: int = 128) -> Generation:
        """Answer `question` over reusable `chunks` (documents), reusing whatever the store holds of them."""
        request = self.build_request(chunks, question, system)
        return self.generate(request, method, SamplingParams(max_tokens=max_tokens))

    @torch.inference_mode()
    def answer_logprobs(self, request: Request, method: str | None, answer: str) -> torch.Tensor:
        """Log-probabilities of `answer`'s tokens after the method's prefill (teacher-forced)."""
        answer_ids = self.tokenizer.encode(answer, add_special_tokens=False)
        if not answer_ids:
            raise ValueError("answer: must contain at least one token")
        fused = self.prefill(request, method, extra_capacity=len(answer_ids))
        logits = [fused.logits] + [self.model.decode(t, fused.cache) for t in answer_ids[:-1]]
        logprobs = torch.log_softmax(torch.stack(logits).float(), dim=-1)
        return logprobs[torch.arange(len(answer_ids)), torch.tensor(answer_ids)]

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.store.close()
