"""A fusion plan: for every layer, which prompt rows are computed and which come from stored KV.

Every method (full, prefix, naive, CacheBlend, LegoLink, CacheTune) is a policy that fills one of these; the
executor runs any of them with the same layer loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvreuse.fusion.segments import Request, Segment, SegmentKind


@dataclass
class PlacedSegment:
    """A segment of the request with what the store holds for it."""

    segment: Segment
    key: str | None = None  # store key of its stored KV (None: fresh, never stored)
    hit: bool = False
    ranking: torch.Tensor | None = None  # CacheTune's per-token score, when the entry has one
    restored: int = 0  # leading tokens of an exact prefix restored before the plan runs (a batch's restoration)
    tier: int | None = None  # the first store tier holding it, when hit
    split: PrefixSplit | None = None  # an exact prefix's stored blocks, restored inside the plan

    @property
    def reusable(self) -> bool:
        return self.hit and self.segment.kind in (SegmentKind.PREFIX, SegmentKind.CHUNK)


@dataclass(frozen=True)
class Block:
    """A stored prefix block as a request uses it: cache rows [rows.start, rows.stop) come from entry `key`.

    rows may stop short of the block's end: the last prompt token is always computed, never loaded."""

    index: int
    key: str
    rows: slice
    tier: int
    stored_tokens: int  # tokens the entry holds (the block size; fewer for a prefix's partial last block)

    @property
    def length(self) -> int:
        return self.rows.stop - self.rows.start

    def overlap(self, rows: slice) -> slice:
        """The part of `rows` inside this block, relative to the block's first row."""
        start, stop = max(rows.start, self.rows.start), min(rows.stop, self.rows.stop)
        return slice(start - self.rows.start, max(start, stop) - self.rows.start)


@dataclass(frozen=True)
class PrefixSplit:
    """How a stored exact prefix comes back inside a plan, as the restorer decided: its blocks' rows are loaded,
    except the first `computed_rows` rows (token-wise: Cake, CacheFlow's token pointer), and only from layer
    `computed_layers` on (layer-wise: CacheFlow's layer pointer); what is not loaded is computed, exactly."""

    strategy: str  # load, compute, cake or layerwise
    blocks: list[Block]
    lost: frozenset[str] = frozenset()  # keys of blocks found unreadable during the request: computed
    computed_rows: int = 0
    computed_layers: int = 0
    # Read each block's layers in one read instead of one read per layer: where every read pays a device's
    # latency, 30 of them per block cost more than the overlap of layer by layer reads gains.
    read_whole: bool = False

    @property
    def rows(self) -> int:
        """Prompt rows the stored blocks cover: [0, rows)."""
        return self.blocks[-1].rows.stop if self.blocks else 0


@dataclass
class ReusedSpan:
    """Stored KV placed at `start`: rows `load` of the entry (indices into it) are read, for every layer from
    `from_layer` on (the layers below compute those rows: a prefix restored layer-wise), and not below
    `first_read_layer` (layers that compute every row of the span anyway: CacheBlend's layer 0, whose stored KV
    would be overwritten unread)."""

    key: str
    start: int
    length: int  # rows of the prompt it covers
    load: torch.Tensor  # sorted entry rows to read; the others are recomputed, so never transferred
    approximate: bool  # a chunk at a new position (narrowing may recompute it), not an exact prefix
    from_layer: int = 0
    stored_tokens: int | None = None  # tokens the entry holds, when more than `length` (a clipped prefix block)
    read_whole: bool = False  # read every layer from `from_layer` on at once, not one layer per read
    first_read_layer: int = 0

    @property
    def rows(self) -> torch.Tensor:
        return self.start + self.load

    @property
    def reads_from(self) -> int:
        """The first layer whose stored KV is read."""
        return max(self.from_layer, self.first_read_layer)

    @property
    def reads_whole_entry(self) -> bool:
        return self.load.numel() == (self.stored_tokens or self.length)


@dataclass
class Narrowing:
    """After computing layer `layer`'s KV for the selected rows, keep recomputing only the `keep` share of the
    approximate rows whose KV deviates most from the stored KV (CacheBlend's HKVD tokens); the rest keep their
    stored KV. Selections are nested: a row dropped here is never computed again.

    With `max_residual`, the share is a floor: more of the most deviating rows are kept until the deviation left
    on the dropped rows, relative to the stored KV's energy on every approximate row, is at most `max_residual`
    (a per-request guard: a request whose chunks interact strongly recomputes more, up to every row)."""

    layer: int
    keep: float
    max_residual: float | None = None
    # Weigh each row's deviation (and its stored energy) by the attention the question's rows pay it at this
    # layer: a row the question ignores matters less however far it strays.
    query_aware: bool = False

    def kept_rows(self, approximate_rows: int) -> int:
        """The approximate rows the `keep` share stands for."""
        return round(self.keep * approximate_rows)


@dataclass
class FusionPlan:
    method: str
    num_rows: int
    reused: list[ReusedSpan]
    compute_rows: torch.Tensor  # rows computed from layer 0 on, sorted; always includes the last row
    narrowing: list[Narrowing] = field(default_factory=list)
    restored_rows: int = 0  # rows [0, restored_rows) hold exact KV before the plan runs (a restored prefix)
    # Approximate rows computed on every layer whatever their deviation (a guard's sinks and recent rows)
    pinned_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    def __post_init__(self) -> None:
        if self.compute_rows.numel() == 0 or int(self.compute_rows[-1]) != self.num_rows - 1:
            raise ValueError("a plan must compute the last prompt row: its hidden state gives the first token")
        if self.restored_rows and int(self.compute_rows[0]) < self.restored_rows:
            raise ValueError("a plan must not compute restored rows: they hold exact KV already")
        if not bool(torch.isin(self.pinned_rows, self.compute_rows).all()):
            raise ValueError("a plan's pinned rows must be computed rows")
        if self.narrowing and any(s.load.numel() != s.length for s in self.reused if s.approximate):
            raise ValueError("narrowing compares recomputed KV with stored KV, so approximate spans load every row")

    @property
    def loaded_chunk_rows(self) -> torch.Tensor:
        """Rows of reused chunks whose stored KV is read."""
        rows = [s.rows for s in self.reused if s.approximate]
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)

    def loaded_rows_at(self, layer: int) -> torch.Tensor:
        """Prompt rows whose stored KV is read for `layer`, in the loader's order (span by span)."""
        rows = [s.rows for s in self.reused if s.load.numel() and s.reads_from <= layer]
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)

    def leaving_rows(self) -> dict[int, torch.Tensor]:
        """layer -> the computed rows whose stored KV is loaded from that layer on (a prefix restored
        layer-wise): they stop being computed there."""
        rows: dict[int, list[torch.Tensor]] = {}
        for span in self.reused:
            if span.from_layer:
                rows.setdefault(span.from_layer, []).append(span.rows)
        return {layer: torch.cat(parts) for layer, parts in rows.items()}

    @property
    def approximate_mask(self) -> torch.Tensor:
        """[num_rows] bool: rows of reused chunks that narrowing may stop recomputing (never the last row, which
        runs to the end: its hidden state gives the first token)."""
        mask = torch.zeros(self.num_rows, dtype=torch.bool)
        for span in self.reused:
            mask[span.start : span.start + span.length] = span.approximate
        mask[-1] = False
        return mask

    @property
    def narrowable_mask(self) -> torch.Tensor:
        """[num_rows] bool: the approximate rows a narrowing may drop (the pinned ones stay)."""
        mask = self.approximate_mask
        mask[self.pinned_rows] = False
        return mask

    @property
    def approximate_rows(self) -> int:
        """Rows of reused chunks: what a recompute ratio is a share of."""
        return sum(s.length for s in self.reused if s.approximate)


def plan_from_rows(
    method: str,
    request: Request,
    placed: list[PlacedSegment],
    recompute: dict[int, torch.Tensor] | None = None,
    reuse: bool = True,
    narrowing: list[Narrowing] | None = None,
    load_recomputed: bool = False,
    pinned: dict[int, torch.Tensor] | None = None,
) -> FusionPlan:
    """Build a plan: reusable hits are loaded (if `reuse`), except the rows `recompute[i]` (indices into
    segment i) which are computed from layer 0 on along with every segment that is not reused. With
    `load_recomputed`, those rows' stored KV is read too (narrowing compares against it); `pinned[i]` (indices
    into segment i) are recomputed rows no narrowing drops. An exact prefix's
    restored rows (if `reuse`) are neither loaded nor computed: they come with the starting cache."""
    recompute = recompute or {}
    reused, compute = [], []
    restored_rows = sum(p.restored for p in placed) if reuse else 0
    for i, p in enumerate(placed):
        rows = torch.arange(len(p.segment.token_ids))
        if reuse and p.split is not None:
            spans, computed = split_spans(p.split, p.segment)
            reused += spans
            compute.append(computed)
            continue
        if not (reuse and p.reusable):
            compute.append(p.segment.start + rows[p.restored if reuse else 0:])
            continue
        chosen = recompute.get(i, torch.empty(0, dtype=torch.long))
        if i == len(placed) - 1:  # the last prompt row is always computed: its hidden state gives the first token
            chosen = torch.cat([chosen, rows[-1:]])
        chosen = chosen.unique()
        kept = torch.ones(rows.numel(), dtype=torch.bool)
        if not load_recomputed:
            kept[chosen] = False
        approximate = p.segment.kind == SegmentKind.CHUNK
        # Layer 0 computes every row of this span and no check compares them there: its stored rows go unread.
        every_row_at_0 = load_recomputed and chosen.numel() == rows.numel() and all(n.layer for n in narrowing or [])
        reused.append(ReusedSpan(p.key, p.segment.start, rows.numel(), rows[kept], approximate,
                                 first_read_layer=int(every_row_at_0)))
        compute.append(p.segment.start + chosen)
    compute_rows = torch.cat(compute).sort().values if compute else torch.empty(0, dtype=torch.long)
    pinned_rows = [placed[i].segment.start + rows for i, rows in (pinned or {}).items()]
    pinned_rows = torch.cat(pinned_rows).unique() if pinned_rows else torch.empty(0, dtype=torch.long)
    return FusionPlan(method, len(request), reused, compute_rows, narrowing or [], restored_rows, pinned_rows)


def split_spans(split: PrefixSplit, segment: Segment) -> tuple[list[ReusedSpan], torch.Tensor]:
    """A prefix segment under `split`: a span per block with rows to load, and the segment's rows computed
    (from layer 0; a layer-wise split's loaded rows leave the computation at the span's `from_layer`)."""
    spans = []
    for block in split.blocks:
        if block.key in split.lost:
            continue
        first_loaded = min(max(split.computed_rows - block.rows.start, 0), block.length)
        if first_loaded < block.length:
            spans.append(ReusedSpan(block.key, block.rows.start, block.length,
                                    torch.arange(first_loaded, block.length), False, split.computed_layers,
                                    block.stored_tokens, split.read_whole))
    computed = torch.ones(len(segment.token_ids), dtype=torch.bool)
    for span in spans:
        if not span.from_layer:
            computed[span.rows - segment.start] = False
    return spans, segment.start + computed.nonzero().flatten()
