"""The analyses' measures on hand-made cases: spectra, rank correlation, HKVD selection, deviations and masses."""

import math

import pytest
import torch

from kvreuse.eval.analyses.deviation import random_rows, spearman, top_rows
from kvreuse.eval.analyses.probe import attention_deviation, attention_mass, kv_deviation
from kvreuse.eval.analyses.spectrum import band_energy
from kvreuse.fusion.compile import band_norms
from kvreuse.model.kv_cache import KVCache


def test_constant_signal_has_all_its_energy_in_the_lowest_band():
    share = band_energy(torch.full((64, 3), 2.5))
    assert share[0] == pytest.approx(1.0) and share[1:].sum() == pytest.approx(0.0, abs=1e-12)


def test_alternating_signal_has_all_its_energy_in_the_highest_band():
    share = band_energy(torch.tensor([[1.0], [-1.0]] * 32))
    assert share[-1] == pytest.approx(1.0)


def test_band_energy_follows_parseval_and_removing_the_mean_removes_dc():
    n = 50
    t = torch.arange(n, dtype=torch.float64)
    slow, fast = torch.cos(2 * math.pi * 2 * t / n), torch.cos(2 * math.pi * 20 * t / n)  # bins 2 and 20 of 26
    signal = torch.stack([3 + slow, 2 * fast], dim=1)  # energies: DC 9n, slow n/2, fast 4n/2
    share = band_energy(signal)
    total = 9 * n + n / 2 + 2 * n
    assert share[0] == pytest.approx((9 * n + n / 2) / total)  # DC and bin 2 are in the lowest tenth
    assert share[7] == pytest.approx(2 * n / total)  # bin 20 of 26 bins
    assert band_energy(signal, remove_mean=True)[0] == pytest.approx(0.5 / 2.5)


def test_low_and_high_bands_split_the_signal():
    keys = torch.randn(2, 40, 3, 4, generator=torch.Generator().manual_seed(0))
    constant = torch.ones(2, 40, 3, 4)
    low, high = band_norms(constant, constant, band="low"), band_norms(constant, constant, band="high")
    torch.testing.assert_close(low, torch.full_like(low, math.sqrt(12)))
    torch.testing.assert_close(high, torch.zeros_like(high), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="band"):
        band_norms(keys, keys, band="middle")


def test_spearman_of_rankings():
    a = torch.tensor([0.3, 1.2, -4.0, 7.0, 2.0])
    assert spearman(a, a) == pytest.approx(1.0)
    assert spearman(a, a.exp()) == pytest.approx(1.0)  # only the order counts
    assert spearman(a, -a) == pytest.approx(-1.0)
    # ranks [1,2,0,4,3] vs [0,1,2,3,4], squared differences 1+1+4+1+1: 1 - 6 * 8 / (5 * 24)
    assert spearman(a, torch.arange(5.0)) == pytest.approx(0.6)


def test_hkvd_selection_picks_the_most_deviating_rows():
    rows = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    deviation = torch.tensor([0.1, 5.0, 0.3, 4.0, 0.0, 0.2, 9.0, 0.4, 0.5, 0.6])
    assert top_rows(deviation, rows, 0.3).tolist() == [11, 13, 16]
    assert top_rows(deviation, rows, 0.0).numel() == 0
    chosen = random_rows(rows, 0.5, torch.Generator().manual_seed(0))
    assert chosen.numel() == 5 and set(chosen.tolist()) <= set(rows.tolist())


def _cache(keys: torch.Tensor, values: torch.Tensor) -> KVCache:
    cache = KVCache(keys.shape[0], keys.shape[2], keys.shape[3], torch.float32, keys.shape[1])
    cache.allocate(torch.arange(keys.shape[1]))
    for layer in range(keys.shape[0]):
        cache.write(layer, slice(None), keys[layer], values[layer])
    return cache


def test_kv_deviation_is_the_l2_distance_of_each_token():
    keys, values = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    moved_keys, moved_values = keys.clone(), values.clone()
    moved_keys[1, 2] = torch.tensor([[3.0, 0.0]])
    moved_values[1, 2] = torch.tensor([[0.0, 4.0]])
    deviation = kv_deviation(_cache(moved_keys, moved_values), _cache(keys, values), torch.tensor([1, 2]))
    assert deviation.tolist() == [[0.0, 0.0], [0.0, 5.0]]


def test_attention_mass_and_deviation():
    weights = torch.softmax(torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0)), -1)  # [heads, rows, keys]
    assert attention_mass([weights], torch.arange(8)).item() == pytest.approx(1.0)
    one_hot = torch.zeros(1, 1, 4)
    one_hot[..., 0] = 1
    assert attention_mass([one_hot], torch.tensor([0, 2])).item() == 1.0
    assert attention_deviation([weights], [weights]).item() == 0.0
    other = torch.zeros(1, 1, 4)
    other[..., 1] = 1
    assert attention_deviation([one_hot], [other]).item() == pytest.approx(math.sqrt(2))
