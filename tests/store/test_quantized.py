"""The optional int8 form: lossy within half a quantisation step, half the bytes, same partial reads."""

from __future__ import annotations

import pytest
import torch

from kvreuse.store.codec import BufferSource, EntryReader, _from_f32, _to_f32, encode, quantize_int8
from kvreuse.store.spec import open_tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_within_half_a_step_and_the_dtypes_rounding(blob_tier_maker, make_entry, dtype):
    tier = blob_tier_maker(quantize=True)
    entry = make_entry(extras=True, dtype=dtype)
    tier.put(entry)
    got = tier.get(entry.key)
    assert got.meta.quantized == "int8" and got.k.dtype == entry.k.dtype and "(int8)" in tier.name
    for stored, read in ((entry.k, got.k), (entry.v, got.v)):
        _, scale = quantize_int8(stored)
        rounding = 0.0 if dtype == torch.float32 else read.float().abs() * torch.finfo(dtype).eps / 2
        assert ((read.float() - stored.float()).abs() <= scale[..., None] / 2 + rounding + 1e-6).all()
        assert not torch.equal(read, stored)  # it really is the lossy form
    assert torch.equal(got.meta.ranking, entry.meta.ranking)  # extras stay exact


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_entry_with_a_value_that_is_not_finite_is_not_written_in_int8(blob_tier_maker, make_entry, bad):
    """Its row's scale would be infinite and the whole row read back as NaN: wrong KV, where a miss is right."""
    tier = blob_tier_maker(quantize=True)
    entry = make_entry()
    entry.k[0, 0, 0, 0] = bad
    tier.put(entry)
    assert tier.get(entry.key) is None and tier.stats()["write_errors"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_numpy_float_conversions_match_torch(dtype):
    x = torch.randn(1000) * 1e3
    assert torch.equal(_from_f32(x.numpy(), dtype), x.to(dtype))  # same rounding as torch
    assert torch.equal(torch.from_numpy(_to_f32(x.to(dtype))), x.to(dtype).float())


def test_int8_holds_about_half_the_bytes_of_bf16(make_entry):
    entry = make_entry(dtype=torch.bfloat16, dim=64)
    assert len(encode(entry, quantize=True)) < 0.6 * len(encode(entry))


@pytest.mark.parametrize("rows,layers", [([99, 3, 64], range(1, 3)), (list(range(100)), None)])
def test_partial_reads_match_the_whole_entry(blob_tier_maker, make_entry, rows, layers):
    tier = blob_tier_maker(quantize=True)
    entry = make_entry(dtype=torch.float16)
    tier.put(entry)
    whole = tier.get(entry.key)
    lay = slice(None) if layers is None else slice(layers.start, layers.stop)
    k, v = tier.get_rows(entry.key, rows, layers)
    assert torch.equal(k, whole.k[lay][:, rows]) and torch.equal(v, whole.v[lay][:, rows])
    k, v = tier.get_layers(entry.key, 1, 2)
    assert torch.equal(k, whole.k[1:2]) and torch.equal(v, whole.v[1:2])


def test_a_flipped_scale_is_caught(blob_tier_maker, make_entry):
    tier = blob_tier_maker(quantize=True)
    entry = make_entry()
    data = bytearray(encode(entry, quantize=True))
    data[EntryReader(BufferSource(bytes(data)), entry.key).tensors["v.2.scale"].start + 1] ^= 0x10
    tier._write(entry.key, bytes(data))
    assert tier.get_rows(entry.key, [0], range(2, 3)) is None and tier.stats()["damaged"] == 1


def test_int8_spec(tmp_path):
    assert open_tier(f"int8:disk:{tmp_path}").quantize
    with pytest.raises(ValueError, match="int8 applies to disk and redis"):
        open_tier("int8:memory:1GB")
