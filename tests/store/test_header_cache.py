"""A blob tier parses an entry's header once for the bytes it was parsed from: a plan reads each entry layer by
layer, and parsing the header was most of a one-layer read. Bytes that changed are parsed again. The rows a read
asks for are planned once as well."""

from __future__ import annotations

import torch

from kvreuse.store.codec import encode


def test_a_second_read_of_the_same_bytes_fetches_only_its_rows(blob_tier_maker, make_entry):
    tier = blob_tier_maker()
    entry = make_entry(layers=4, tokens=32)
    assert tier.put(entry)
    layer_bytes = entry.k[0].nbytes + entry.v[0].nbytes

    def fetched(layer: int) -> int:
        before = tier.stats()["bytes_read"]
        k, v = tier.get_layers(entry.key, layer, layer + 1)
        assert torch.equal(k, entry.k[layer : layer + 1]) and torch.equal(v, entry.v[layer : layer + 1])
        return tier.stats()["bytes_read"] - before

    assert fetched(0) > layer_bytes  # the header too
    assert fetched(1) == fetched(2) == layer_bytes


def test_rewritten_bytes_are_parsed_again(blob_tier_maker, make_entry):
    tier = blob_tier_maker()
    old = make_entry(layers=2, tokens=32)
    assert tier.put(old)
    tier.get_layers(old.key, 0, 1)
    new = make_entry(old.key, layers=3, tokens=48)  # another entry's bytes under the same key
    tier._write(old.key, encode(new))
    k, _ = tier.get_layers(old.key, 2, 3)
    assert torch.equal(k, new.k[2:3])


def test_the_rows_a_read_asks_for_are_planned_once_per_parsed_header(blob_tier_maker, make_entry, monkeypatch):
    """A plan reads the same rows of an entry every few layers: which row groups hold them (and where each row lands)
    is worked out on the first read and kept with the header; other rows get their own plan."""
    from kvreuse.store import codec

    planned = []
    plan_rows = codec.EntryReader._plan_rows
    monkeypatch.setattr(codec.EntryReader, "_plan_rows",
                        lambda self, rows: planned.append(rows) or plan_rows(self, rows))
    tier = blob_tier_maker()
    entry = make_entry(layers=4, tokens=100)
    assert tier.put(entry)
    rows, other = torch.tensor([70, 3, 41, 42]), torch.arange(20, 60)
    for layer in range(4):
        for asked in (rows, other, rows):
            k, v = tier.get_rows(entry.key, asked, range(layer, layer + 1))
            expected = slice(layer, layer + 1), asked
            assert torch.equal(k, entry.k[expected]) and torch.equal(v, entry.v[expected])
    assert [r.tolist() for r in planned] == [rows.tolist(), other.tolist()]
    for first in range(codec.ROW_PLANS_KEPT + 1):  # more row sets than are kept: each still read right
        asked = torch.arange(first, first + 5)
        assert torch.equal(tier.get_rows(entry.key, asked, range(1, 2))[0], entry.k[1:2, asked])
