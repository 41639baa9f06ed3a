"""The entry format: standard safetensors, no pickle, and partial reads that read only what they need."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kvreuse.store.codec import BufferSource, EntryDamaged, EntryReader, _checksum, decode, encode, scatter
from kvreuse.store.disk import FileSource
from kvreuse.store.entry import EntryMeta, KVEntry
from kvreuse.store.redis import RedisSource


class CountingSource(BufferSource):
    def __init__(self, data: bytes):
        super().__init__(data)
        self.bytes_read = 0

    def _fetch(self, spans):
        self.bytes_read += sum(n for _, n in spans)
        return super()._fetch(spans)


def test_file_is_plain_safetensors(tmp_path, make_entry):
    entry = make_entry(dtype=torch.bfloat16, extras=True)
    path = tmp_path / "e.safetensors"
    path.write_bytes(encode(entry))
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["format"] == "kvreuse-kv/2"
        order = json.loads(f.metadata()["entry"])["row_order"]  # ranked: least important row first
        assert torch.equal(f.get_tensor("k.2"), entry.k[2][order])
        assert torch.equal(entry.meta.ranking[order], entry.meta.ranking.sort(stable=True).values)
        assert torch.equal(f.get_tensor("ranking"), entry.meta.ranking)


def test_partial_reads_read_only_what_they_need(make_entry):
    entry = make_entry(layers=8, tokens=256)  # 16 row groups of 16 per tensor
    data = encode(entry)
    tensor_bytes = entry.k[0].numel() * 4

    def bytes_for(read) -> int:
        source = CountingSource(data)
        read(EntryReader(source, entry.key))
        return source.bytes_read

    header = bytes_for(lambda r: None)
    assert bytes_for(lambda r: r.read()) - header == 16 * tensor_bytes
    assert bytes_for(lambda r: r.read(range(2, 4))) - header == 4 * tensor_bytes
    # Rows 5 and 70 lie in two of the sixteen row groups: an eighth of each of the 16 tensors.
    assert bytes_for(lambda r: r.read(None, [70, 5])) - header == 16 * tensor_bytes // 8
    assert bytes_for(lambda r: r.read(range(7, 8), [255])) - header == 2 * tensor_bytes // 16


def test_decode_checks_the_key(make_entry):
    entry = make_entry()
    assert torch.equal(decode(BufferSource(encode(entry)), entry.key).v, entry.v)
    with pytest.raises(EntryDamaged, match="holds key"):
        decode(BufferSource(encode(entry)), make_entry().key)


@pytest.mark.parametrize("change,message", [
    (dict(k=torch.zeros(4, 100, 2, 8)), "share a 4-d shape"),
    (dict(k=torch.zeros(4, 100, 2, 16, dtype=torch.float16)), "dtypes"),
    (dict(layers=3), "meta says"),
    (dict(ranking=torch.zeros(5)), "ranking"),
    (dict(ranking=torch.zeros(100, dtype=torch.float64)), "unsupported KV dtype"),
    (dict(key="bad/key"), "invalid store key"),
])
def test_inconsistent_entries_are_refused(make_entry, change, message):
    e = make_entry()
    meta = EntryMeta("m", "float32", change.get("layers", 4), 100, ranking=change.get("ranking"))
    with pytest.raises(ValueError, match=message):
        KVEntry(change.get("key", e.key), change.get("k", e.k), e.v, meta)


@pytest.mark.parametrize("header", [b"123", b"[]", b'{"__metadata__": 5}', b'{"__metadata__": {}}', b"\xff\xfe",
                                    b"[" * 100_000])  # nested past Python's recursion limit, as other bytes can be
def test_malformed_headers_are_damage(make_entry, header):
    data = len(header).to_bytes(8, "little") + header
    with pytest.raises(EntryDamaged):
        EntryReader(BufferSource(data), make_entry().key)


def test_random_bytes_are_damage(make_entry):
    gen = torch.Generator().manual_seed(0)
    for size in (0, 7, 8, 100, 5000):
        with pytest.raises(EntryDamaged):
            decode(BufferSource(torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8).numpy().tobytes()),
                   make_entry().key)


def test_scatter_copies_pieces_into_buffers_across_their_boundaries():
    buffers = [bytearray(2), bytearray(4), bytearray(2)]
    scatter((0, 8), [b"abc", b"", b"defgh"], buffers)
    assert [bytes(b) for b in buffers] == [b"ab", b"cdef", b"gh"]
    with pytest.raises(EntryDamaged, match="short read at 0: 7 of 8"):
        scatter((0, 8), [b"abc", b"defg"], buffers)


def test_read_into_fills_each_buffer_with_its_range():
    source = BufferSource(bytes(range(32)))
    buffers = [bytearray(4), bytearray(3), bytearray(5)]
    source.read_into([(10, 4), (2, 3), (5, 5)], buffers)  # the last two touch: one span
    assert [bytes(b) for b in buffers] == [bytes(range(10, 14)), bytes(range(2, 5)), bytes(range(5, 10))]
    with pytest.raises(ValueError, match="overlapping"):
        source.read_into([(0, 4), (2, 4)], [bytearray(4), bytearray(4)])
    with pytest.raises(ValueError, match="a buffer of 3 bytes for a range of 4"):
        source.read_into([(0, 4)], [bytearray(3)])
    with pytest.raises(EntryDamaged, match="past the end"):
        source.read_into([(30, 4)], [bytearray(4)])


def test_blob_tiers_read_kv_straight_into_the_tensors_they_return(blob_tier_maker, make_entry, monkeypatch):
    """K/V bytes go from the backend into the tensor handed back (a file's preadv; Redis's pieces copied once),
    never first joined into bytes of their own (`_fetch`, which serves headers)."""
    tier = blob_tier_maker()
    entry = make_entry(layers=4, tokens=100, extras=True)
    assert tier.put(entry)
    tier.get_layers(entry.key, 0, 4)  # the header, parsed once and kept

    def joined(self, spans):
        raise AssertionError("K/V fetched as joined bytes")

    monkeypatch.setattr(FileSource, "_fetch", joined)
    monkeypatch.setattr(RedisSource, "_fetch", joined)
    k, v = tier.get_layers(entry.key, 1, 3)
    assert torch.equal(k, entry.k[1:3]) and torch.equal(v, entry.v[1:3])
    rows = torch.tensor([70, 5, 99])
    k, v = tier.get_rows(entry.key, rows, range(4))
    assert torch.equal(k, entry.k[:, rows]) and torch.equal(v, entry.v[:, rows])


def test_blob_tiers_hand_the_placer_the_groups_read_with_the_rows_to_pick(blob_tier_maker, make_entry, monkeypatch):
    """view_picking gathers nothing: rows out of order come as the row groups read (16 rows each here) with their
    indices among them; a run of rows as a view of the groups, whatever group it starts in. Nor does
    view_layers_picking: an entry kept in rank order comes as read, with the token order to pick."""
    tier = blob_tier_maker()
    entry = make_entry(layers=4, tokens=100)
    assert tier.put(entry)

    def gathered(*args):
        raise AssertionError("rows gathered into a copy")

    monkeypatch.setattr("kvreuse.store.codec.take_rows", gathered)
    rows = torch.tensor([70, 5, 99, 70])
    k, v, picks = tier.view_picking(entry.key, rows, range(1, 3))
    assert k.shape[:2] == (2, 16 + 16 + 4) and picks.tolist() == [16 + 6, 5, 32 + 3, 16 + 6]  # groups 0, 4, 6
    assert torch.equal(k[:, picks], entry.k[1:3, rows]) and torch.equal(v[:, picks], entry.v[1:3, rows])
    before = tier.stats()["bytes_read"]
    k, v, picks = tier.view_picking(entry.key, torch.arange(20, 90), range(4))
    assert picks is None and torch.equal(k, entry.k[:, 20:90]) and torch.equal(v, entry.v[:, 20:90])
    assert k._base is not None or k.storage_offset()  # the run a view of the groups read
    assert tier.stats()["bytes_read"] - before == 2 * 4 * (96 - 16) * entry.k[0, 0].nbytes  # groups 1-5
    ranked = make_entry(layers=4, tokens=100, extras=True)  # rows kept in rank order
    assert tier.put(ranked)
    k, v, picks = tier.view_layers_picking(ranked.key, 1, 3)
    assert sorted(picks.tolist()) == list(range(100)) and picks.tolist() != list(range(100))
    assert torch.equal(k[:, picks], ranked.k[1:3]) and torch.equal(v[:, picks], ranked.v[1:3])


def test_a_disk_read_of_more_buffers_than_one_preadv_takes_reads_them_in_turn(tmp_path, make_entry, monkeypatch):
    """Every layer's K lies end to end: a whole read is one span of as many buffers as layers, which preadv takes
    at most IOV_MAX at a time, each batch at the offset where the last one stopped."""
    from kvreuse.store import disk

    tier = disk.DiskTier(tmp_path)
    entry = make_entry(layers=5)
    assert tier.put(entry)
    monkeypatch.setattr(disk, "IOV_MAX", 2)
    k, v = tier.get_layers(entry.key, 0, 5)
    assert torch.equal(k, entry.k) and torch.equal(v, entry.v)


def edited_header(data: bytes, edit) -> bytes:
    """The entry with its safetensors header (the parsed JSON) edited, the data after it as it was."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    packed = json.dumps(header).encode()
    packed += b" " * (-len(packed) % 8)
    return len(packed).to_bytes(8, "little") + packed + data[8 + n :]


def resigned(data: bytes, edit) -> bytes:
    """The entry with its metadata edited and signed again: consistent bytes from a writer that got it wrong."""
    def edit_signed(header: dict) -> None:
        info = json.loads(header["__metadata__"]["entry"])
        edit(info)
        text = json.dumps(info, sort_keys=True)
        header["__metadata__"].update(entry=text, entry_checksum=_checksum(text.encode()))
    return edited_header(data, edit_signed)


@pytest.mark.parametrize("edit, message", [
    (lambda i: i.update(row_group=0), "row_group"),
    (lambda i: i.update(row_group="16"), "row_group"),
    (lambda i: i["checksums"].update({"k.0": i["checksums"]["k.0"][:1]}), "k.0 has 1 checksums, not 7"),
    (lambda i: i["checksums"].update({"v.3": "abc"}), "checksums.`v.3`"),
    (lambda i: i.pop("compile_mode"), "compile_mode"),
    (lambda i: i.pop("quantized"), "quantized"),
    (lambda i: i.update(boundary_layers=5), "boundary_layers"),
    (lambda i: i.update(boundary_layers=None), "boundary_layers"),
    (lambda i: i.update(num_layers=0), "num_layers"),
    (lambda i: i.update(num_layers=True), "num_layers"),
    (lambda i: i.update(dtype="float64"), "dtype"),
    (lambda i: i.update(model_fingerprint=7), "model_fingerprint"),
])
def test_metadata_signed_but_wrong_is_damage(make_entry, edit, message):
    entry = make_entry()  # 100 tokens: 7 row groups of 16
    reader = EntryReader(BufferSource(resigned(encode(entry), lambda i: None)), entry.key)
    assert torch.equal(reader.read()[0], entry.k) and reader.meta().compile_mode == entry.meta.compile_mode
    with pytest.raises(EntryDamaged, match=message):
        decode(BufferSource(resigned(encode(entry), edit)), entry.key)


def _tensor(name: str, **fields):
    def edit(header: dict) -> None:
        header[name].update(fields)
    return edit


@pytest.mark.parametrize("edit, message", [
    (_tensor("ranking", shape=[4, 25]), "ranking is"),  # the same bytes, another shape
    (_tensor("ranking", dtype="I8", shape=[400]), "ranking is"),  # the same bytes, another dtype
    (_tensor("boundary", shape=[1, 200, 8]), "boundary is"),
    (_tensor("ranking", shape=[-100]), "shape"),
    (_tensor("k.0", dtype="F64"), "dtype"),
    (_tensor("k.0", data_offsets=[0]), "data_offsets"),
])
def test_a_tensor_table_that_does_not_fit_the_metadata_is_damage(make_entry, edit, message):
    """The safetensors table outside the signed metadata: every tensor's dtype, shape and extent is checked
    against what the metadata says the entry holds, extras included (CacheTune indexes its ranking by token)."""
    entry = make_entry(extras=True)
    reader = EntryReader(BufferSource(edited_header(encode(entry), lambda h: None)), entry.key)
    assert torch.equal(reader.meta().ranking, entry.meta.ranking)
    with pytest.raises(EntryDamaged, match=message):
        EntryReader(BufferSource(edited_header(encode(entry), edit)), entry.key)


@pytest.mark.parametrize("quantize", [False, True])
def test_an_entry_file_holds_its_layers_in_order_each_tensor_aligned(tmp_path, make_entry, quantize):
    """Where safetensors' writer orders tensors by name (k.10 between k.1 and k.2), an entry file holds K's layers
    in order, equally spaced, then V's, the widest dtype first so that every tensor starts aligned; safetensors
    still reads it."""
    entry = make_entry(layers=12, dtype=torch.bfloat16, extras=True)
    data = encode(entry, quantize=quantize)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__")
    assert (8 + n) % 8 == 0
    by_offset = sorted(header, key=lambda name: header[name]["data_offsets"][0])
    sizes = {"F32": 4, "BF16": 2, "I8": 1}
    assert [sizes[header[name]["dtype"]] for name in by_offset] == sorted(
        (sizes[header[name]["dtype"]] for name in by_offset), reverse=True)
    assert all(header[name]["data_offsets"][0] % sizes[header[name]["dtype"]] == 0 for name in header)
    for kv in "kv":
        starts = [header[f"{kv}.{layer}"]["data_offsets"][0] for layer in range(12)]
        assert starts == list(range(starts[0], starts[0] + 12 * (starts[1] - starts[0]), starts[1] - starts[0]))
    path = tmp_path / "e.safetensors"
    path.write_bytes(data)
    order = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["entry"])["row_order"]
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(header)
        if not quantize:
            assert torch.equal(f.get_tensor("k.11"), entry.k[11][order])
