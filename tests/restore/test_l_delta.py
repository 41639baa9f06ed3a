"""L_delta: the crossover of measured token-wise and layer-wise times, saved per model and tier under the cache
folder, and used by strategy="auto"."""

import torch

from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore import PrefixRestorer, l_delta
from kvreuse.store import KeySpace, open_store


def test_crossover_is_the_first_length_where_layer_wise_is_not_clearly_faster():
    assert l_delta.crossover({256: 3.0, 512: 2.0, 1024: 1.0}, {256: 1.0, 512: 2.0, 1024: 3.0}) == 512
    assert l_delta.crossover({256: 2.0, 512: 4.0}, {256: 1.0, 512: 3.0}) == 513  # layer-wise throughout
    # 2% faster is within the benchmark's own spread: token-wise from the first length on
    assert l_delta.crossover({256: 3.36, 512: 3.67}, {256: 3.29, 512: 3.81}) == 256
    assert l_delta.crossover({256: 2.01, 512: 2.10}, {256: 1.72, 512: 2.04}) == 512  # 14% faster: a real win


def test_auto_follows_the_saved_threshold(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    model = LayerwiseModel(make_tiny("llama"))
    restorer = PrefixRestorer(model, open_store("memory:64MB"), KeySpace("tiny", "tok"), block_size=8)
    ids = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    restorer.store_prefix(ids)
    assert restorer.restore(ids, "auto").stats["strategy"] == "cake"  # not profiled: token-wise
    assert l_delta.save("tiny", "memory", {16: 2.0, 64: 1.0}, {16: 1.0, 64: 2.0}) == 64
    assert (tmp_path / "restore" / "l_delta.json").is_file()
    assert restorer.restore(ids, "auto").stats["strategy"] == "layerwise"  # 40 stored tokens < 64
    restorer.store_prefix(ids * 2)
    assert restorer.restore(ids * 2, "auto").stats["strategy"] == "cake"  # 88 stored tokens >= 64


def test_cli_registers_the_restore_commands():
    from kvreuse.cli import build_parser

    args = build_parser().parse_args(["bench", "restore", "--tiers", "hdd", "--lengths", "512", "--layers", "0"])
    assert args.tiers == ["hdd"] and args.lengths == [512] and args.layers == 0
    assert args.batch_tiers == ["hdd", "ssd", "memory"] and args.batch_io[0] == "auto" and not args.batch_only
    args = build_parser().parse_args(["profile", "l-delta", "--tiers", "memory", "ssd"])
    assert args.tiers == ["memory", "ssd"] and args.func.__name__ == "cmd_l_delta"


def test_an_unreadable_profile_file_is_no_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    path = l_delta.profile_path()
    path.parent.mkdir(parents=True)
    for text in ("{not json", "[1, 2]", '{"tiny/memory": {"tokens": 3}}', '{"tiny/memory": 7}', "\xff"):
        path.write_text(text, encoding="latin-1")
        assert l_delta.threshold("tiny", "memory") is None, text
    assert l_delta.save("tiny", "memory", {16: 2.0}, {16: 1.0}) == 17  # a save replaces the damaged file
    assert l_delta.threshold("tiny", "memory") == 17
