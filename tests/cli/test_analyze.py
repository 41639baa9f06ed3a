"""`kvreuse analyze NAME` end to end on one real example with a tiny random-weight model: every analysis writes
its PNG and JSON, and the numbers keep the invariants that hold whatever the weights."""

import json

import pytest

from kvreuse.cli import main
from kvreuse.cli.analyze import ANALYSES

from ..eval.support import DATASETS


@pytest.fixture(scope="module")
def analyses(tiny_model_dir, tmp_path_factory):
    """Every analysis run once; name -> its JSON document."""
    out = tmp_path_factory.mktemp("analyses")
    for name in ANALYSES:
        argv = ["analyze", name, "--dataset", str(DATASETS / "2wikimqa.jsonl"), "--limit", "1",
                "--model", str(tiny_model_dir), "--out", str(out)]
        assert main(argv) == 0
        assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    return {name: json.loads((out / f"{name}.json").read_text()) for name in ANALYSES}


def test_hkvd_curves_run_from_naive_to_full(analyses):
    curves = analyses["hkvd"]["curves"]
    assert set(curves) == {"HKVD (oracle ranking)", "random", "CacheBlend gradual filtering"}
    everything, nothing = curves["HKVD (oracle ranking)"]["1.0"], curves["HKVD (oracle ranking)"]["0.0"]
    assert everything["attention_deviation"] == pytest.approx(0, abs=1e-5)
    assert everything["first_token_kl"] == pytest.approx(0, abs=1e-6)
    assert nothing == curves["random"]["0.0"]  # r = 0 is naive reuse whatever the ranking
    assert nothing["kv_deviation"] > 0


def test_layer_correlation_reports_an_exact_layer_zero(analyses):
    numbers = analyses["layer-correlation"]
    assert numbers["layer0_max_deviation"] == 0.0  # K and V of layer 0 depend on the token alone
    assert all(-1 <= s <= 1 for s in numbers["spearman_mean"])


def test_spectrum_shares_are_shares(analyses):
    for signal in analyses["spectrum"]["signals"].values():
        assert sum(signal["band_share_mean"]) == pytest.approx(1.0)
        assert all(0 <= s <= 1 for s in signal["low20_share_per_layer"])


def test_frequency_selection_oracles_and_coverage(analyses):
    selections = analyses["frequency-selection"]["selections"]
    assert selections["HKVD (oracle)"]["hkvd_precision"] == 1.0
    assert selections["first tokens of each chunk"]["chunk_starts_covered"] == 1.0
    assert selections["naive (r = 0)"]["kv_deviation"] > 0
    first_token = analyses["frequency-selection"]["chunk_first_token"]
    assert 0 <= first_token["percentile_in_low_frequency_score"] <= 1 and first_token["k_norm_vs_rest"] > 0


def test_sinks_measure_every_method(analyses):
    methods = analyses["sinks"]["methods"]
    assert list(methods) == ["full", "naive", "legolink:2", "legolink:16", "legolink0", "cacheblend:0.15",
                             "cachetune:0.15"]
    assert methods["full"]["first_token_kl"] == 0.0
    assert all(0 <= m["mass_on_chunk_starts_mean"] <= 1 for m in methods.values())


def test_unknown_dataset_fails_before_the_model_loads(tmp_path, capsys):
    assert main(["analyze", "sinks", "--dataset", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("limit, warned", [("5", True), ("6", False)])
def test_fidelity_signal_warns_when_too_few_examples_leave_its_correlations_empty(limit, warned, tmp_path, capsys):
    """It runs (the other figures hold), but says so: with fewer than 6, every held-out correlation is null."""
    argv = ["analyze", "fidelity-signal", "--dataset", str(DATASETS / "2wikimqa.jsonl"), "--limit", limit,
            "--model", str(tmp_path / "no-model"), "--out", str(tmp_path)]
    assert main(argv) == 2  # the missing model stops it once the examples are counted
    err = capsys.readouterr().err
    assert ("fidelity-signal on 5 example(s): its figures need 6" in err) == warned
    assert "no-model" in err


def test_fidelity_signal_guards_recompute_more_the_tighter_they_are(analyses):
    summary = analyses["fidelity-signal"]["summary"]
    for method, guards in (("guarded", ("1e-3", "5e-4", "2.5e-4")), ("guarded-query", ("2e-3", "1e-3", "5e-4"))):
        shares = [summary[f"{method}:{d}"]["mean_recompute_share"] for d in guards]
        assert shares == sorted(shares), method
    assert summary["naive"]["mean_recompute_share"] == 0
    spearman = analyses["fidelity-signal"]["held_out_spearman"]
    assert set(spearman) == {"deviation mass", "question-weighted mass", "output uncertainty"}
    example = analyses["fidelity-signal"]["examples"][0]["methods"]["cacheblend:0.15"]
    assert example["deviation_mass"] >= example["deviation_residual"] > 0
    assert 0 <= example["uncertainty"] < 1


@pytest.mark.parametrize("name, takes", [("hkvd", {"--seed"}), ("layer-correlation", {"--ratio"}),
                                          ("frequency-selection", {"--ratio", "--seed"}), ("spectrum", set()),
                                          ("sinks", set()), ("fidelity-signal", set())])
def test_an_analysis_offers_only_the_settings_it_reads(name, takes, capsys):
    with pytest.raises(SystemExit):
        main(["analyze", name, "--help"])
    help_text = capsys.readouterr().out
    offered = {flag for flag in ("--ratio", "--seed") if flag in help_text}
    assert offered == takes


def test_fidelity_signal_defaults_to_enough_examples_for_its_held_out_correlations():
    """Its rank correlations are over the odd examples and need 3: the default 4 of the others gave none."""
    from kvreuse.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["analyze", "fidelity-signal", "--dataset", "x.jsonl"]).limit == 20
    assert parse(["analyze", "sinks", "--dataset", "x.jsonl"]).limit == 4
