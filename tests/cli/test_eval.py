"""`kvreuse eval` end to end on real data with a tiny random-weight model: the plumbing, not the numbers."""

import json

from kvreuse.cli import main

from ..eval.support import DATASETS


def test_eval_writes_every_method_and_resumes(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["eval", "--dataset", str(DATASETS / "2wikimqa.jsonl"), "--limit", "3", "--model", str(tiny_model_dir)]
    # one method per compile mode (plain, behind dummy tokens, with a stored ranking) keeps this test short;
    # full is left out on purpose: the runner must add it, first
    argv += ["--methods", "naive,cacheblend:0.15,legolink0,cachetune:0.15"]
    argv += ["--out", str(out), "--max-tokens", "2", "--no-progress"]
    assert main(argv) == 0
    methods = ["full", "naive", "cacheblend:0.15", "legolink0", "cachetune:0.15"]

    document = json.loads((out / "results.json").read_text())
    summary = {m["method"]: m for m in document["methods"]}
    assert list(summary) == methods and all(m["examples"] == 3 for m in summary.values())
    assert summary["full"]["agreement"] == 1.0 and summary["full"]["first_token_kl"] == 0.0
    assert summary["naive"]["recompute_share"] == 0.0 and summary["cacheblend:0.15"]["recompute_share"] > 0.0
    assert summary["full"]["recompute_share"] is None and "| full | 3 |" in (out / "results.md").read_text()
    assert all(r["gold_loglik"] < 0 and r["ttft"] > 0 for r in document["examples"])
    table = (out / "results.md").read_text()
    assert all(f"| {m} | 3 |" in table for m in methods)
    assert (out / "quality_vs_ttft.png").read_bytes().startswith(b"\x89PNG")
    printed = capsys.readouterr()
    assert printed.out.startswith("| method |") and "found fewer of their chunks" not in printed.err

    cached = (out / "examples.jsonl").read_text()
    assert len(cached.splitlines()) == 3 * len(methods)
    assert main(argv) == 0  # a second run finds every result cached and computes nothing
    assert (out / "examples.jsonl").read_text() == cached


def test_eval_runs_methods_in_bf16_against_fp32_full(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["eval", "--dataset", str(DATASETS / "2wikimqa.jsonl"), "--limit", "2", "--model", str(tiny_model_dir),
            "--methods", "full@bfloat16,cacheblend:0.15@bfloat16", "--out", str(out), "--max-tokens", "2",
            "--no-progress"]
    assert main(argv) == 0
    summary = {m["method"]: m for m in json.loads((out / "results.json").read_text())["methods"]}
    assert list(summary) == ["full", "full@bfloat16", "cacheblend:0.15@bfloat16"]
    # bf16's own rounding is a (small) deviation from the fp32 reference; its full recomputes every row
    assert 0 < summary["full@bfloat16"]["first_token_kl"] < 0.05
    assert summary["cacheblend:0.15@bfloat16"]["recompute_share"] > 0


def test_eval_runs_methods_on_an_engine_decoding_over_int8_weights(tiny_model_dir, tmp_path, monkeypatch):
    """full@int8-decode: fp32's prefill (its first token's KL is 0) on an engine whose decoding is int8's."""
    from kvreuse.model.runtime import LayerwiseModel

    switched = []
    decode_in_int8 = LayerwiseModel.decode_in_int8
    monkeypatch.setattr(LayerwiseModel, "decode_in_int8",
                        lambda self, enabled=True: switched.append(enabled) or decode_in_int8(self, enabled))
    out = tmp_path / "out"
    argv = ["eval", "--dataset", str(DATASETS / "2wikimqa.jsonl"), "--limit", "2", "--model", str(tiny_model_dir),
            "--methods", "full@int8-decode", "--out", str(out), "--max-tokens", "3", "--no-progress"]
    assert main(argv) == 0 and switched == [True]
    summary = {m["method"]: m for m in json.loads((out / "results.json").read_text())["methods"]}
    assert list(summary) == ["full", "full@int8-decode"] and summary["full@int8-decode"]["first_token_kl"] == 0


def test_eval_warns_when_the_store_cannot_hold_an_example_s_chunks(tiny_model_dir, tmp_path, capsys):
    argv = ["eval", "--dataset", str(DATASETS / "2wikimqa.jsonl"), "--limit", "1", "--model", str(tiny_model_dir),
            "--methods", "naive", "--store", "memory:20KB", "--out", str(tmp_path), "--max-tokens", "2",
            "--no-progress"]
    assert main(argv) == 0
    assert "found fewer of their chunks in the store than were compiled" in capsys.readouterr().err
