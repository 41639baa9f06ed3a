"""`kvreuse bench ttft` plumbing: a tiny random model, two short lengths, the vLLM peer skipped. Timings are never
asserted; the structure is, and that every ratio and statistic is computed from the measured samples."""

import json

import numpy as np
import pytest

from kvreuse.bench.ttft import NO_TIER, Cell
from kvreuse.bench.ttft_report import summarize
from kvreuse.bench.workload import Shape
from kvreuse.cli import main

METHODS = ["full", "naive", "cacheblend:0.15"]


@pytest.fixture(scope="module")
def ttft_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ttft")
    args = ["bench", "ttft", "--lengths", "96,160", "--chunks", "2", "--repeats", "2", "--tiers", "memory,disk",
            "--methods", "naive,cacheblend:0.15", "--peers", "transformers,vllm", "--vllm-venv", str(out / "no-venv"),
            "--model", str(tiny_model_dir), "--out", str(out)]
    assert main(args) == 0
    return out


def test_writes_json_markdown_and_plot(ttft_run):
    assert {p.name for p in ttft_run.iterdir()} >= {"ttft.json", "ttft.md", "ttft.png"}
    assert ttft_run.joinpath("ttft.png").read_bytes().startswith(b"\x89PNG")
    assert "| memory | cacheblend:0.15 |" in ttft_run.joinpath("ttft.md").read_text()


def test_every_variant_of_every_shape_is_reported(ttft_run):
    report = json.loads(ttft_run.joinpath("ttft.json").read_text())
    assert "no vLLM venv" in report["peers"]["vllm"]["skipped"]
    assert report["tier_specs"]["memory"] == "memory:8GB" and report["tier_specs"]["disk"].startswith("disk:/")
    expected = {(NO_TIER, "full"), (NO_TIER, "transformers:full"), (NO_TIER, "transformers:prefix")}
    expected |= {(tier, m) for tier in ("memory", "disk") for m in METHODS[1:]}
    for tokens in (96, 160):
        rows = [r for r in report["results"] if r["tokens"] == tokens and r["chunks"] == 2]
        assert {(r["tier"], r["variant"]) for r in rows} == expected
        assert all(r["completed"] == 2 and len(r["ttfts_ms"]) == 2 for r in rows)
        assert all(abs(r["prompt_tokens_mean"] - tokens) <= 4 for r in rows)


def test_ratios_and_limits_come_from_the_measured_samples(ttft_run):
    report = json.loads(ttft_run.joinpath("ttft.json").read_text())
    for tokens in (96, 160):
        rows = {(r["tier"], r["variant"]): r for r in report["results"] if r["tokens"] == tokens}
        full = rows[NO_TIER, "full"]
        for row in rows.values():
            samples = np.array(row["ttfts_ms"])
            assert row["mean_ttft_ms"] == pytest.approx(samples.mean())
            assert row["p99_ttft_ms"] == pytest.approx(np.percentile(samples, 99))
            assert row["ratio_to_full"]["mean"] == pytest.approx(row["mean_ttft_ms"] / full["mean_ttft_ms"])
            assert row["ratio_to_full"]["median"] == pytest.approx(row["median_ttft_ms"] / full["median_ttft_ms"])
            if row["engine"] == "kvreuse":
                assert row["mean_over_limit"] == pytest.approx(row["mean_ttft_ms"] / row["limit_ms"])
            else:
                assert row["limit_ms"] is None
        # full computes every row and loads nothing: its limit is its own median time
        assert full["limit_ms"] == pytest.approx(full["median_ttft_ms"])
        assert rows["memory", "naive"]["limit_ms"] < full["limit_ms"]


def test_summary_of_known_samples():
    shape = Shape(1024, 4)
    cells = {
        (shape, NO_TIER, "full"): Cell("kvreuse", seconds=[1.0, 2.0, 3.0], limits=[2.0], recompute_shares=[0.0]),
        (shape, "memory", "naive"): Cell("kvreuse", seconds=[0.5, 0.5, 0.5], limits=[0.25], recompute_shares=[0.0]),
        (shape, NO_TIER, "vllm:prefix"): Cell("vllm", seconds=[4.0, 4.0, 4.0], cached_tokens=[256, 256, 256]),
    }
    raw = {"cells": cells, "prompt_tokens": {shape: [1020]}}
    rows = {(r["tier"], r["variant"]): r for r in summarize(raw)}
    assert list(rows) == [(NO_TIER, "full"), ("memory", "naive"), (NO_TIER, "vllm:prefix")]
    naive, vllm = rows["memory", "naive"], rows[NO_TIER, "vllm:prefix"]
    assert naive["ratio_to_full"]["mean"] == pytest.approx(0.25)  # 500 ms / 2000 ms
    assert naive["ratio_to_full"]["median"] == pytest.approx(0.25)
    assert naive["mean_over_limit"] == pytest.approx(2.0) and naive["gap_to_limit_ms"] == pytest.approx(250.0)
    assert vllm["ratio_to_full"]["mean"] == pytest.approx(2.0) and vllm["cached_tokens_mean"] == 256
    assert rows[NO_TIER, "full"]["p90_ttft_ms"] == pytest.approx(2800.0)


def test_rejects_an_unknown_peer(capsys):
    assert main(["bench", "ttft", "--peers", "sglang"]) == 2
    assert "unknown peer 'sglang'" in capsys.readouterr().err


def test_an_out_path_that_is_a_file_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    import kvreuse.cli.bench as bench_cli

    monkeypatch.setattr(bench_cli, "measure", lambda settings: pytest.fail("measured before --out was checked"))
    taken = tmp_path / "afile"
    taken.write_text("")
    assert main(["bench", "ttft", "--peers", "none", "--out", str(taken)]) == 2
    assert f"--out {taken}: not a folder" in capsys.readouterr().err


def test_the_header_says_when_vllm_was_not_asked_for():
    from kvreuse.bench.ttft_report import _header_lines

    raw = {"model": "m", "source": "s", "duration_seconds": 1.0, "prompt_tokens": {}, "peers": {},
           "settings": {"prompts": 1, "repeats": 1}}
    assert ("vLLM:", "not asked for (--peers)") in _header_lines(raw, [])


@pytest.mark.parametrize("naive_limit, warned", [(0.25, False), (1.0, True)])
def test_a_method_under_its_limit_is_named(capsys, naive_limit, warned):
    """A limit above the method's time (full prefill's time, which it scales, measured slow) is warned of."""
    from kvreuse.bench.ttft_report import print_report

    shape = Shape(1024, 4)
    cells = {
        (shape, NO_TIER, "full"): Cell("kvreuse", seconds=[1.0, 2.0, 3.0], limits=[2.0], recompute_shares=[0.0]),
        (shape, "memory", "naive"): Cell("kvreuse", seconds=[0.5] * 3, limits=[naive_limit], recompute_shares=[0.0]),
    }
    raw = {"cells": cells, "prompt_tokens": {shape: [1020]}, "model": "m", "source": "s", "duration_seconds": 1.0,
           "peers": {}, "settings": {"prompts": 1, "repeats": 3}}
    print_report(raw, summarize(raw))
    out = capsys.readouterr().out
    assert ("warning: naive on memory at 1024 tokens took 500.0 ms, under its limit of 1000.0 ms" in out) == warned
    assert "warning: full" not in out
