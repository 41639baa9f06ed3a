"""CacheTune's sparse transfer reads about the share of the bytes it keeps, measured by the tier: entries with a
ranking keep their rows in rank order, least important first, so the rows CacheTune loads (all but its top r)
are one run at the front of each tensor, and reads hand them back in token order."""

from __future__ import annotations

import pytest
import torch

from kvreuse.fusion.methods import shares_of

from .conftest import _make_entry

LAYERS = 4


def loaded_rows(ranking: torch.Tensor, ratio: float) -> torch.Tensor:
    """The rows CacheTune at `ratio` loads: all but the top `ratio` of the ranking, in token order."""
    recomputed = torch.zeros(ranking.numel(), dtype=torch.bool)
    recomputed[ranking.topk(shares_of([ranking.numel()], ratio)[0]).indices] = True
    return (~recomputed).nonzero().flatten()


def bytes_read(tier, read) -> tuple[int, object]:
    before = tier.stats()["bytes_read"]
    result = read()
    return tier.stats()["bytes_read"] - before, result


@pytest.mark.parametrize("tokens", [160, 500])
@pytest.mark.parametrize("ratio", [0.15, 0.5])
def test_a_sparse_read_reads_about_the_share_of_rows_it_keeps(blob_tier_maker, tokens, ratio):
    """SmolLM2's rows (3 KV heads x 64 dims): loading 1 - r of the rows reads at most 1 - r + 10% of the bytes
    a whole read of the same layers does, and gives exactly the stored rows asked for."""
    tier = blob_tier_maker()
    entry = _make_entry(layers=LAYERS, tokens=tokens, heads=3, dim=64, extras=True)
    assert tier.put(entry)
    whole, _ = bytes_read(tier, lambda: tier.get_layers(entry.key, 0, LAYERS))
    rows = loaded_rows(entry.meta.ranking, ratio)
    sparse, (k, v) = bytes_read(tier, lambda: tier.get_rows(entry.key, rows, range(LAYERS)))
    assert torch.equal(k, entry.k[:, rows]) and torch.equal(v, entry.v[:, rows])
    assert sparse <= (1 - ratio + 0.10) * whole, (sparse, whole)
    assert whole >= entry.k.nbytes + entry.v.nbytes  # the tier counts what it fetched, not what it handed back


def test_a_whole_read_of_a_rank_ordered_entry_is_in_token_order(blob_tier_maker):
    tier = blob_tier_maker()
    entry = _make_entry(layers=LAYERS, tokens=100, extras=True)
    assert tier.put(entry)
    k, v = tier.get_layers(entry.key, 1, 3)
    assert torch.equal(k, entry.k[1:3]) and torch.equal(v, entry.v[1:3])
    assert torch.equal(tier.get(entry.key).k, entry.k)
    shuffled = torch.randperm(100, generator=torch.Generator().manual_seed(5))
    k, _ = tier.get_rows(entry.key, shuffled)
    assert torch.equal(k, entry.k[:, shuffled])
