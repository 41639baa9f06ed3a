"""The restoration benchmark's ideal: the best split of the prefix between computing its front and loading its
back, from measured spans of each side; `bench restore` and `profile l-delta` end to end."""

import json

import pytest

from kvreuse.bench.restore import _paired, ideal_seconds
from kvreuse.cli import build_parser, main


def test_ideal_splits_where_compute_of_the_front_meets_load_of_the_back():
    compute = [[0, 4, 0.4], [4, 8, 0.4]]  # 0.1 s per position
    load = [[0, 4, 0.1], [4, 8, 0.1]]  # 0.025 s per position: they cross at x = 1.6 (0.16 s each side)
    assert ideal_seconds(compute, load, remainder=0.05) == pytest.approx(0.16 + 0.05)


def test_ideal_is_never_worse_than_either_side_alone():
    compute, load = [[0, 8, 0.2]], [[0, 8, 5.0]]
    assert ideal_seconds(compute, load, 0.0) <= 0.2
    assert ideal_seconds([[0, 8, 5.0]], [[0, 8, 0.2]], 0.0) <= 0.2


def test_paired_ratio_keeps_what_a_repeat_s_variants_share_out_of_the_ratio():
    """Cake 5% slower than load-only in every repeat while the machine's speed changes between repeats: the
    paired ratio is 1.05; the ratio of medians depends on which repeats were slow for which variant."""
    speed = [1.0, 1.5, 1.0, 1.5, 1.5]
    load = [0.1 * s for s in speed]
    cake = [0.105 * s for s in speed]
    assert _paired(cake, load) == pytest.approx(1.05)
    assert _paired(load, load) == 1.0


def test_bench_restore_runs_end_to_end(tmp_path, capsys):
    """Plumbing: the embedded model cut to one layer, a short prefix on memory and an emulated ssd, a batch of two
    on the ssd, timings unread."""
    out = tmp_path / "restore.json"
    assert main(["bench", "restore", "--layers", "1", "--tiers", "memory", "ssd", "--lengths", "64", "--repeats", "1",
                 "--block", "32", "--batch-tiers", "ssd", "--batch-lengths", "64", "128", "--batch-repeats", "1",
                 "--batch-compute-workers", "1", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    rows, batches = figures["rows"], figures["batches"]
    assert [(row["tier"], row["prefix"]) for row in rows] == [("memory", 64), ("ssd", 64)]
    assert rows[0]["emulated"] is None and rows[1]["emulated"].startswith("ssd (emulated")  # as the table says
    assert [(batch["tier"], batch["lengths"]) for batch in batches] == [("ssd", [64, 128])]
    assert batches[0]["emulated"] == rows[1]["emulated"]
    assert "Prefix restoration" in capsys.readouterr().out


def test_profile_l_delta_saves_under_the_fingerprint_it_names(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    assert main(["profile", "l-delta", "--layers", "1", "--tiers", "memory", "--lengths", "64", "--repeats", "1",
                 "--block", "32"]) == 0
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "restore" / "l_delta.json").read_text())
    [entry] = saved
    fingerprint = entry.removesuffix("/memory")
    assert fingerprint.endswith("-layers1") and f"under the fingerprint {fingerprint}" in out
    assert "engines of the whole model do not read it" in out


def test_profile_l_delta_profiles_the_whole_model_by_default():
    """What an engine reads (its model's own fingerprint): a cut model's profile is for benchmarks only."""
    assert build_parser().parse_args(["profile", "l-delta"]).layers == 0
    assert build_parser().parse_args(["bench", "restore"]).layers == 2


def test_a_negative_layer_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "restore", "--layers", "-1"])
    assert "expected a whole number >= 0, got '-1'" in capsys.readouterr().err


def test_a_batch_without_compute_workers_is_refused():
    """No worker would compute its steps (a BatchRestorer of 0 workers is driven by its caller): it would hang."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "restore", "--batch-compute-workers", "0"])


def test_a_prefix_past_the_context_window_is_refused(capsys):
    assert main(["bench", "restore", "--layers", "1", "--tiers", "memory", "--lengths", "8192", "--repeats", "1",
                 "--batch-tiers", "none"]) == 2
    assert "a stored prefix of 8192 tokens and its 32-token turn exceed the model's context window" in (
        capsys.readouterr().err)
