"""`kvreuse bench fusion` runs end to end (plumbing only: a tiny random model, one example, timings unread)."""

import json

import pytest

from kvreuse.bench.tiers import report_name
from kvreuse.cli import main

from ..eval.support import DATASETS

TIERS = ("memory", "disk", "redis", "ssd")  # ssd: an emulated device, named so


def test_fusion_bench_reports_every_method_and_tier(tiny_model_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))  # the machine profile auto measures goes here
    args = ["bench", "fusion", "--dataset", str(DATASETS / "2wikimqa.jsonl"), "--limit", "1", "--repeats", "1",
            "--methods", "naive,cacheblend:0.15,cachetune:0.15,auto", "--tiers", "memory,disk,redis,ssd",
            "--model", str(tiny_model_dir), "--json", str(tmp_path / "fusion.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    for tier in TIERS:
        for method in ("full", "naive", "cacheblend:0.15", "cachetune:0.15", "auto"):
            assert any(tier in line and f" {method} " in line for line in out.splitlines()), (tier, method)
        # no fidelity table for a random model: auto may only choose exact plans, as fast as full at best
        assert f"{report_name(tier)}: auto " in out and "the best fixed method meeting its floor (full" in out
    assert "cost model over every (example, tier, method): median error" in out
    cells = json.loads((tmp_path / "fusion.json").read_text())["cells"]
    assert sorted(cells) == sorted(f"{t}|{m}" for t in TIERS
                                   for m in ("full", "naive", "cacheblend:0.15", "cachetune:0.15", "auto"))
    assert all(len(cell["ttft"]) == 1 and cell["ttft"][0] > 0 for cell in cells.values())


def test_fusion_bench_rejects_an_unknown_method(capsys):
    assert main(["bench", "fusion", "--dataset", "x.jsonl", "--methods", "magic"]) == 2
    assert "unknown method 'magic'" in capsys.readouterr().err


def test_a_tier_that_cannot_hold_a_prompt_s_chunks_is_refused_by_name(tiny_model_dir, capsys, monkeypatch, tmp_path):
    """Its reuse rows would be full prefills under the methods' names."""
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    args = ["bench", "fusion", "--dataset", str(DATASETS / "2wikimqa.jsonl"), "--limit", "1", "--repeats", "1",
            "--methods", "naive", "--tiers", "memory,memory:20KB", "--model", str(tiny_model_dir)]
    assert main(args) == 2
    assert "tier memory:20KB: " in capsys.readouterr().err


@pytest.mark.parametrize("command", [["bench", "fusion", "--dataset", "x.jsonl"], ["bench", "restore"],
                                     ["bench", "connector"], ["cache", "bench"]])
def test_a_figures_file_that_cannot_be_written_is_refused_before_the_run(command, tmp_path, capsys):
    for path, error in [(tmp_path / "missing" / "figures.json", f"its folder '{tmp_path / 'missing'}' does not exist"),
                        (tmp_path, "is a folder, not a file")]:
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--json", str(path)])
        assert exit_info.value.code == 2 and error in capsys.readouterr().err


def test_a_method_under_its_limit_is_named(capsys):
    from kvreuse.bench.fusion import Cell, _print

    def cell(ttft: float, limit: float, method: str) -> Cell:
        return Cell(ttft=[ttft], kl=[0.0], limit=[limit], recompute_share=[0.1], predicted=[ttft], chosen=[method])

    cells = {("ssd", "full"): cell(1.0, 1.0, "full"), ("ssd", "naive"): cell(0.05, 0.2, "naive"),
             ("ssd", "cacheblend:0.15"): cell(0.3, 0.2, "cacheblend:0.15")}
    report = {"dataset": "d", "examples": 1, "prompt_tokens_mean": 900.0, "repeats": 1}
    _print(report, ["full", "naive", "cacheblend:0.15"], ["ssd"], cells)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: naive on {report_name('ssd')} took 50.0 ms, under its limit of 200.0 ms: full "
                        "prefill's time, which the limit scales, was measured slower than it runs; use more "
                        "--repeats or a quiet machine"]
