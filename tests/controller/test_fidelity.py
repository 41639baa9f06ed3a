"""The fidelity table method auto reads: built from eval results, looked up by method and ratio, found on disk."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvreuse.controller.fidelity import (Fidelity, FidelityTable, from_eval_results, load_table, save_table,
                                         user_table_path)
from kvreuse.controller.measure import ensure_profile
from kvreuse.controller.profile import RUNTIME_REVISION, MachineProfile, load_profile, save_profile

from .support import synthetic_profile


def eval_results(path, model: str, dataset: str, rows: dict[str, tuple[float, float]]):
    methods = [{"method": m, "first_token_kl": kl, "agreement": agreement, "examples": 10}
               for m, (kl, agreement) in rows.items()]
    path.write_text(json.dumps({"settings": {"model": model, "dataset": dataset}, "methods": methods}))
    return path


def test_the_table_keeps_each_methods_worst_dataset(tmp_path):
    a = eval_results(tmp_path / "a.json", "m", "2wikimqa", {"naive": (0.4, 0.5), "cacheblend:0.15": (0.15, 0.6)})
    b = eval_results(tmp_path / "b.json", "m", "hotpotqa", {"naive": (0.3, 0.4), "cacheblend:0.15": (0.12, 0.7)})
    table = from_eval_results([a, b])
    assert table.methods["naive"] == Fidelity(0.4, 0.4, 20)
    assert table.methods["cacheblend:0.15"] == Fidelity(0.15, 0.6, 20)
    assert table.sources == ["2wikimqa: 10 examples", "hotpotqa: 10 examples"]


def test_results_of_two_models_make_no_table(tmp_path):
    a = eval_results(tmp_path / "a.json", "m1", "x", {"naive": (0.4, 0.5)})
    b = eval_results(tmp_path / "b.json", "m2", "x", {"naive": (0.4, 0.5)})
    with pytest.raises(ValueError, match="2 models"):
        from_eval_results([a, b])


def test_an_unmeasured_ratio_takes_the_largest_measured_ratio_below_it():
    table = FidelityTable("m", {"cacheblend:0.15": Fidelity(0.15, 0.6), "cacheblend:0.3": Fidelity(0.06, 0.7)})
    assert table.of("cacheblend:0.2") == Fidelity(0.15, 0.6)
    assert table.of("cacheblend:0.45") == Fidelity(0.06, 0.7)
    assert table.of("cacheblend:0.1") is None  # nothing measured below it: unknown, never assumed
    assert table.of("legolink:16") is None
    assert table.of("prefix") == table.of("full") == Fidelity(0.0, 1.0)


def test_an_unmeasured_guard_takes_the_nearest_measured_residual_above_it():
    """A guard's number is the residual it leaves: a larger one recomputes less. guarded:9e-4 took guarded:2.5e-4's
    fidelity, a far more faithful setting's, and met a floor it fails."""
    table = FidelityTable("m", {"guarded:2.5e-4": Fidelity(0.05, 0.9), "guarded:1e-3": Fidelity(0.4, 0.5),
                                "guarded-query:2e-3": Fidelity(0.1, 0.8)})
    assert table.of("guarded:9e-4") == Fidelity(0.4, 0.5)
    assert table.of("guarded:1e-4") == Fidelity(0.05, 0.9)
    assert table.of("guarded:2e-3") is None  # nothing measured that recomputes as little: unknown
    assert table.of("guarded-query:1e-3") == Fidelity(0.1, 0.8) and table.of("guarded-query:3e-3") is None


@pytest.mark.parametrize("name", ["smollm2-135m-instruct.json", "gemma3-270m.json"])
def test_each_measured_models_table_ships_with_the_package(name):
    from importlib import resources

    shipped = json.loads((resources.files("kvreuse.controller") / "fidelity" / name).read_text())
    table = load_table(shipped["model"])
    assert table is not None and table.model == shipped["model"] and table.sources
    assert {"naive", "cacheblend:0.15", "legolink:16", "cachetune:0.15"} <= table.methods.keys()
    assert load_table("no-such-model") is None


def test_a_table_made_on_this_machine_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    own = FidelityTable("m", {"naive": Fidelity(0.1, 0.9)})
    save_table(own, user_table_path("m"))
    assert load_table("m") == own


def test_a_profile_round_trips_and_a_damaged_one_reads_as_none(tmp_path):
    profile = synthetic_profile(1e-5)
    path = save_profile(profile, tmp_path / "p.json")
    assert load_profile("synthetic", "float32", path) == profile
    path.write_text('{"model": "synthetic"')
    assert load_profile("synthetic", "float32", path) is None
    path.write_text('{"model": "synthetic"}')
    assert load_profile("synthetic", "float32", path) is None
    save_profile(replace(profile, runtime_revision=RUNTIME_REVISION - 1), path)
    assert load_profile("synthetic", "float32", path) is None  # measured under older kernels: measured again
    save_profile(profile, path)  # a file given by path: another dtype's or model's is not this one's to merge
    assert load_profile("synthetic", "bfloat16", path) is None and load_profile("other", "float32", path) is None
    with pytest.raises(ValueError, match="machine profile"):
        MachineProfile.from_json({"model": "x"})


@pytest.mark.parametrize("damage, named", [
    (lambda d: d.update(tiers=[]), "not a kvreuse machine profile"),
    (lambda d: d["compute"].update(rows=[64], dense_seconds=[1e-3]), "compute.rows"),
    (lambda d: d["compute"].update(rows=[], dense_seconds=[]), "compute.rows"),
    (lambda d: d["compute"].update(rows=[2048, 64]), "compute.rows"),
    (lambda d: d["compute"].update(dense_seconds=[float("nan"), 1e-3]), "not a finite number >= 0"),
    (lambda d: d["compute"].update(place_seconds="fast"), "not a finite number >= 0"),
    (lambda d: d["tiers"]["ssd"].update(latency_seconds=float("inf")), "not a finite number >= 0"),
    (lambda d: d["tiers"]["memory"].update(bytes_per_second=0), "bytes_per_second"),
    (lambda d: d.update(windows=[None]), "windows: expected one per layer"),
    (lambda d: d.update(tuned_ratios={"cachetune@memory": "0.2"}), "tuned_ratios"),
    (lambda d: d.update(num_layers=0), "num_layers"),
])
def test_a_profile_the_cost_model_cannot_run_on_is_measured_again(damage, named, tmp_path, caplog):
    """JSON takes NaN and a hand edit takes anything: such a profile stopped every engine of the model from
    starting (a division by a one-point grid's width or a zero bandwidth), or method auto at its first request."""
    data = synthetic_profile(1e-5).to_json()
    damage(data)
    with pytest.raises(ValueError, match=named):
        MachineProfile.from_json(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_profile("synthetic", "float32", path) is None
    assert str(path) in caplog.text and "measured again" in caplog.text


def test_a_profile_path_that_cannot_be_read_is_measured_again(tmp_path, caplog):
    (tmp_path / "p.json").mkdir()
    assert load_profile("synthetic", "float32", tmp_path / "p.json") is None
    assert "p.json" in caplog.text


def test_ensure_profile_measures_only_the_tiers_the_saved_profile_lacks(tmp_path, monkeypatch, tiny_model):
    from kvreuse.store.spec import open_store

    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    first = ensure_profile(tiny_model, "tiny", "float32", {"memory": open_store("memory:64MB")})
    again = ensure_profile(tiny_model, "tiny", "float32", {"memory": open_store("memory:64MB")})
    assert again == first  # read back, not measured again
    grown = ensure_profile(tiny_model, "tiny", "float32",
                           {"memory": open_store("memory:64MB"), "ssd": open_store("throttled:ssd:memory:64MB")})
    assert grown.compute == first.compute and grown.tiers["memory"] == first.tiers["memory"]
    assert grown.tiers["ssd"].emulated and not grown.tiers["memory"].emulated
    assert grown.tiers["ssd"].bytes_per_second < grown.tiers["memory"].bytes_per_second


def test_an_earlier_table_folds_into_a_new_one(tmp_path):
    earlier = FidelityTable("m", {"naive": Fidelity(0.4, 0.5, 20), "legolink:16": Fidelity(0.2, 0.5, 20)},
                            ["2wikimqa: 10 examples", "hotpotqa: 10 examples"])
    table_file = save_table(earlier, tmp_path / "table.json")
    samsum = eval_results(tmp_path / "s.json", "m", "samsum", {"naive": (0.3, 0.3), "legolink:16": (0.25, 0.7)})
    table = from_eval_results([table_file, samsum])
    assert table.methods["naive"] == Fidelity(0.4, 0.3, 30)
    assert table.methods["legolink:16"] == Fidelity(0.25, 0.5, 30)
    assert table.sources == ["2wikimqa: 10 examples", "hotpotqa: 10 examples", "samsum: 10 examples"]


def test_a_method_row_with_a_bad_value_is_named(tmp_path):
    results = eval_results(tmp_path / "r.json", "m", "x", {"naive": (0.4, 0.5), "prefix": (-0.1, 1.0)})
    with pytest.raises(ValueError, match="method 'prefix': first_token_kl: expected a number >= 0, got -0.1"):
        from_eval_results([results])


def test_results_of_a_store_too_small_for_an_example_make_no_table(tmp_path):
    """Their runs recomputed the chunks evicted before they were read: the table would promise more than the
    method keeps (the eval warned; the table took them silently)."""
    path = eval_results(tmp_path / "r.json", "m", "x", {"naive": (0.1, 0.9)})
    data = json.loads(path.read_text())
    data["examples"] = [{"method": "naive", "stats": {"chunk_hits": 3, "chunks": 3}},
                        {"method": "naive", "stats": {"chunk_hits": 1, "chunks": 3}}]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="1 runs found fewer of their chunks stored than were compiled"):
        from_eval_results([path])
    data["examples"][1]["stats"]["chunk_hits"] = 3
    path.write_text(json.dumps(data))
    assert from_eval_results([path]).methods["naive"] == Fidelity(0.1, 0.9, 10)


def test_a_file_that_is_neither_results_nor_a_table_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"settings": {}, "methods": [{"method": "naive"}]}))
    with pytest.raises(ValueError, match="neither kvreuse eval results nor a fidelity table"):
        from_eval_results([bad])


def test_a_file_is_named_when_it_cannot_be_read(tmp_path):
    good = eval_results(tmp_path / "good.json", "m", "x", {"naive": (0.4, 0.5)})
    for name, text in [("truncated.json", '{"settings": {'), ("list.json", "[]"), ("empty.json", "")]:
        bad = tmp_path / name
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"{bad}: "):
            from_eval_results([bad, good])


def test_auto_itself_and_other_dtypes_are_left_out_of_a_table(tmp_path):
    """An eval that ran auto or METHOD@bfloat16 gives rows auto cannot plan: a table holding them made every
    auto request fail."""
    rows = {"naive": (0.4, 0.5), "auto": (0.0, 1.0), "auto:kl=0.35": (0.1, 0.8), "full@bfloat16": (0.01, 0.9),
            "cacheblend:0.15@int8-decode": (0.1, 0.8)}
    table = from_eval_results([eval_results(tmp_path / "a.json", "m", "x", rows)])
    assert set(table.methods) == {"naive"}
    saved = {"model": "m", "methods": {m: {"first_token_kl": kl, "agreement": a} for m, (kl, a) in rows.items()}}
    assert set(FidelityTable.from_json(saved).methods) == {"naive"}  # a table saved before this rule


def test_the_same_examples_folded_twice_count_once(tmp_path):
    run = eval_results(tmp_path / "a.json", "m", "2wikimqa", {"naive": (0.4, 0.5)})
    other_run = eval_results(tmp_path / "b.json", "m", "2wikimqa", {"naive": (0.3, 0.6), "legolink:16": (0.2, 0.6)})
    table_file = save_table(from_eval_results([run]), tmp_path / "table.json")
    table = from_eval_results([table_file, run, other_run])
    assert table.methods["naive"] == Fidelity(0.4, 0.5, 10)
    assert table.sources == ["2wikimqa: 10 examples"]


def test_an_unreadable_table_of_this_machine_is_named_and_the_shipped_one_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    path = user_table_path("m")
    path.parent.mkdir(parents=True)
    path.write_text("{half")
    assert load_table("m") is None
    assert str(path) in caplog.text


def test_profile_costs_keeps_the_saved_tiers_and_tuned_ratios_it_does_not_measure(tiny_model_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    """Measuring the disk tier again must not cost the memory tier's measurement and its calibrated ratios."""
    from kvreuse.cli import main
    from kvreuse.model.loader import load_model

    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    fingerprint = load_model(str(tiny_model_dir), "float32").fingerprint
    earlier = replace(synthetic_profile(1e-5), model=fingerprint,
                      tuned_ratios={"cacheblend@memory": 0.3, "cachetune@memory": 0.2})
    save_profile(earlier)
    assert main(["profile", "costs", "--model", str(tiny_model_dir), "--tiers", "disk", "--repeats", "1"]) == 0
    profile = load_profile(fingerprint, "float32")
    assert set(profile.tiers) == {*earlier.tiers, "disk"}
    assert profile.tiers["memory"] == earlier.tiers["memory"] and profile.tuned_ratios == earlier.tuned_ratios
    assert profile.compute != earlier.compute  # measured again
    assert "kept from the saved profile: tiers hdd, memory, ssd; tuned ratios cacheblend@memory 0.3" in (
        capsys.readouterr().out)


@pytest.mark.parametrize("edit, field", [
    (lambda t: t["methods"]["naive"].update(first_token_kl="abc"), "first_token_kl"),
    (lambda t: t["methods"]["naive"].update(first_token_kl=None), "first_token_kl"),
    (lambda t: t["methods"]["naive"].update(first_token_kl=float("nan")), "first_token_kl"),
    (lambda t: t["methods"]["naive"].update(first_token_kl=-0.1), "first_token_kl"),
    (lambda t: t["methods"]["naive"].update(agreement=1.5), "agreement"),
    (lambda t: t["methods"]["naive"].update(examples=2.5), "examples"),
    (lambda t: t.update(model=["m"]), "model"),
    (lambda t: t.update(sources=5), "sources"),
])
def test_a_table_holding_values_of_another_kind_is_refused_where_it_is_read(tmp_path, monkeypatch, caplog, edit,
                                                                            field):
    """Folded into a new table, such a file was saved as it was and then failed every request of method auto
    (a TypeError comparing it with the floor); now it is refused by name, folded or loaded."""
    table = {"model": "m", "methods": {"naive": {"first_token_kl": 0.4, "agreement": 0.5, "examples": 10}},
             "sources": ["x: 10 examples"]}
    edit(table)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=f"{bad}: .*{field}"):
        from_eval_results([bad])
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    path = user_table_path("m")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(table))
    assert load_table("m") is None and field in caplog.text


def test_a_table_that_cannot_be_saved_leaves_the_old_one_and_no_temporary_file(tmp_path, monkeypatch):
    path = save_table(FidelityTable("m", {"naive": Fidelity(0.4, 0.5, 10)}), tmp_path / "table.json")
    old = path.read_text()

    def fails(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", fails)
    with pytest.raises(OSError):
        save_table(FidelityTable("m", {"naive": Fidelity(0.1, 0.9, 10)}), path)
    assert path.read_text() == old and [p.name for p in tmp_path.iterdir()] == ["table.json"]
