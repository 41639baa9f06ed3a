"""`kvreuse bench fusion` runs end to end (plumbing only: a tiny random model, one example, timings unread)."""

from kvreuse.cli import main


def test_fusion_bench_reports_every_method_and_tier(tiny_model_dir, capsys):
    args = ["bench", "fusion", "--dataset", "../shared/datasets/2wikimqa.jsonl", "--limit", "1", "--repeats", "1",
            "--methods", "naive,cacheblend:0.15,cachetune:0.15", "--model", str(tiny_model_dir)]
    assert main(args) == 0
    out = capsys.readouterr().out
    for tier in ("memory", "disk"):
        for method in ("full", "naive", "cacheblend:0.15", "cachetune:0.15"):
            assert any(tier in line and f" {method} " in line for line in out.splitlines()), (tier, method)


def test_fusion_bench_rejects_an_unknown_method(capsys):
    assert main(["bench", "fusion", "--dataset", "x.jsonl", "--methods", "magic"]) == 2
    assert "unknown method 'magic'" in capsys.readouterr().err
