"""The memory tier's reads for callers that only read: consecutive rows are its own tensors, not copies."""

from __future__ import annotations

import pytest
import torch

from kvreuse.store.entry import consecutive
from kvreuse.store.memory import MemoryTier


@pytest.mark.parametrize("rows,run", [([3, 4, 5], slice(3, 6)), ([7], slice(7, 8)), ([], None), ([3, 5], None),
                                      ([4, 3], None), ([2, 2], None), ([2, 3, 3, 4], None), ([0, 1, 3, 2], None),
                                      ([3, 5, 4, 6], None)])
def test_consecutive_is_a_slice_only_for_rows_that_run_up_one_at_a_time(rows, run):
    assert consecutive(torch.tensor(rows, dtype=torch.long)) == run


def test_view_rows_hands_out_the_stored_tensors_for_consecutive_rows(make_entry):
    tier = MemoryTier(64 << 20)
    entry = make_entry()
    tier.put(entry)
    stored = tier.entries[entry.key]
    k, v = tier.view_rows(entry.key, torch.arange(16, 90), range(1, 3))
    assert k.data_ptr() == stored.k[1, 16].data_ptr() and v.data_ptr() == stored.v[1, 16].data_ptr()
    assert all(layer.is_contiguous() for layer in (*k, *v))  # what the model's placer takes without a copy
    assert tier.stats()["bytes_read"] == k.nbytes + v.nbytes


def test_view_rows_copies_rows_that_do_not_run_in_order(make_entry):
    tier = MemoryTier(64 << 20)
    entry = make_entry()
    tier.put(entry)
    k, _ = tier.view_rows(entry.key, torch.tensor([4, 5, 7]))
    k.zero_()
    assert torch.equal(tier.entries[entry.key].k[:, [4, 5, 7]], entry.k[:, [4, 5, 7]])


def test_view_picking_hands_out_the_stored_layers_and_counts_only_the_picked_rows(make_entry):
    """Rows out of order (CacheTune's) are left to the placer to pick from the tier's own tensors: no gathered copy,
    and the bytes read are those of the rows picked."""
    tier = MemoryTier(64 << 20)
    entry = make_entry()
    tier.put(entry)
    stored = tier.entries[entry.key]
    rows = torch.tensor([4, 5, 7, 30])
    k, v, picks = tier.view_picking(entry.key, rows, range(1, 3))
    assert k.data_ptr() == stored.k[1].data_ptr() and v.data_ptr() == stored.v[1].data_ptr()
    assert torch.equal(picks, rows) and k.shape[:2] == (2, entry.meta.num_tokens)
    assert tier.stats()["bytes_read"] == 2 * k[:, rows].nbytes
    k, v, picks = tier.view_picking(entry.key, torch.arange(16, 90), range(1, 3))
    assert picks is None and k.data_ptr() == stored.k[1, 16].data_ptr() and k.shape[:2] == (2, 74)
