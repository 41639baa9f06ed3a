import json
from dataclasses import replace

import pytest
import torch

from kvreuse.eval.datasets import ChunkedPrompt, Dataset
from kvreuse.eval.runner import (
    MethodResult,
    MethodSpecError,
    ResultCache,
    RunSettings,
    aggregate,
    engine_options,
    parse_methods,
    run,
    split_dtype,
)

from .support import BEHAVIOUR, FakeEngine

METHODS = ["full", "naive", "cacheblend:0.15"]
SETTINGS = RunSettings(model="fake-model", dataset="toy", chunking="passage", max_tokens=8, store="memory")


def toy_dataset(n: int = 2) -> Dataset:
    prompts = [
        ChunkedPrompt(f"q{i}", ["Passage 1: A\na", "Passage 2: B\nb"], "Question: ?\nAnswer:", ["Free Guy"], "qa")
        for i in range(n)
    ]
    return Dataset("toy", "qa", prompts, max_tokens=32, first_line=True)


def test_parse_methods_puts_full_first():
    assert parse_methods("naive,cacheblend:0.15,full,legolink0") == ["full", "naive", "cacheblend:0.15", "legolink0"]
    assert parse_methods("naive") == ["full", "naive"]


@pytest.mark.parametrize(
    "spec", ["", "naive,,full", "cacheblend:x", "cacheblend:2", "naive:3", "Naive", "blend:0.1", "naive,naive"]
)
def test_parse_methods_rejects_bad_lists(spec):
    with pytest.raises(MethodSpecError, match="--methods"):
        parse_methods(spec)


def test_a_dtype_suffix_is_parsed_and_checked():
    assert parse_methods("naive@bfloat16,full@bfloat16") == ["full", "naive@bfloat16", "full@bfloat16"]
    assert split_dtype("cacheblend:0.15@bfloat16") == ("cacheblend:0.15", "bfloat16")
    assert split_dtype("naive") == ("naive", None)
    assert parse_methods("full@int8-decode") == ["full", "full@int8-decode"]
    assert engine_options("int8-decode") == {"dtype": "float32", "decode_weights": "int8"}
    assert engine_options("bfloat16") == {"dtype": "bfloat16"}
    for spec in ("naive@int3", "naive@", "nave@bfloat16", "naive@int8"):
        with pytest.raises(MethodSpecError, match="--methods"):
            parse_methods(spec)


def test_methods_in_another_dtype_run_on_its_engine_against_the_run_s_full(tmp_path):
    """full@bfloat16 is bf16's own deviation from the reference, which stays the main engine's full."""
    main, bf16 = FakeEngine(), FakeEngine(text_override={"full": "Forbidden Ground"})
    methods = ["full", "full@bfloat16", "naive@bfloat16"]
    results = run(main, toy_dataset(1), methods, SETTINGS, ResultCache(tmp_path / "r.jsonl"), False,
                  engines={"bfloat16": bf16})
    full, full_bf16, naive_bf16 = results
    assert [r.method for r in results] == methods
    assert main.calls[("generate", "full")] == 1 and main.calls[("generate", "naive")] == 0
    assert bf16.calls[("generate", "full")] == 1 and bf16.calls[("generate", "naive")] == 1
    assert (full.agreement, full_bf16.agreement, full_bf16.output) == (1.0, 0.0, "Forbidden Ground")
    assert naive_bf16.first_token_kl > 0 and naive_bf16.ttft == BEHAVIOUR["naive"][2]


def test_each_engine_compiles_only_its_own_methods_under_their_plain_names(tmp_path):
    main, bf16 = FakeEngine(), FakeEngine()
    run(main, toy_dataset(1), ["full", "naive", "cacheblend:0.15@bfloat16"], SETTINGS,
        ResultCache(tmp_path / "r.jsonl"), False, engines={"bfloat16": bf16})
    assert main.compiled == ["full", "naive"] and bf16.compiled == ["cacheblend:0.15"]


def test_run_measures_every_method_against_full(tmp_path):
    results = run(FakeEngine(), toy_dataset(1), METHODS, SETTINGS, ResultCache(tmp_path / "r.jsonl"), False)
    full, naive, blend = results
    assert [r.method for r in results] == METHODS
    assert (full.output, full.agreement, full.first_token_kl, full.score) == ("Free Guy", 1.0, 0.0, 1.0)
    assert (naive.agreement, naive.score) == (0.0, 0.0)
    assert blend.agreement == pytest.approx(0.8)  # "free guy film" vs "Free Guy"
    # KL(full || naive): full is softmax([2, 0, 0]), naive is uniform over 3 tokens
    p = torch.softmax(torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64), 0)
    assert naive.first_token_kl == pytest.approx(float((p * (p * 3).log()).sum()))
    assert blend.first_token_kl > 0
    assert full.gold_loglik == pytest.approx(-3.0) and naive.gold_loglik == pytest.approx(-1.5)
    assert (blend.ttft, blend.recompute_share) == (0.2, 0.15)
    assert full.recompute_share is None  # it reused no chunk row: no share of them, rather than 0 as naive's


def test_first_line_datasets_stop_generating_at_the_end_of_the_first_line(tmp_path):
    engine = FakeEngine()
    run(engine, toy_dataset(1), ["full", "naive"], SETTINGS, ResultCache(tmp_path / "r.jsonl"), False)
    assert [s.stop for s in engine.samplings] == [["\n"], ["\n"]]
    assert all(s.max_tokens == SETTINGS.max_tokens for s in engine.samplings)


def test_an_output_opening_with_a_newline_is_generated_again_without_the_stop(tmp_path):
    engine = FakeEngine(text_override={"naive": "\nForbidden Ground\nmore"})
    naive = run(engine, toy_dataset(1), ["full", "naive"], SETTINGS, ResultCache(tmp_path / "r.jsonl"), False)[1]
    assert naive.output == "Forbidden Ground"  # the first non-empty line, as without the stop
    assert engine.calls[("generate", "naive")] == 2 and engine.samplings[-1].stop == []


def test_run_resumes_from_the_cache_file(tmp_path):
    path = tmp_path / "r.jsonl"
    first = run(FakeEngine(), toy_dataset(), METHODS, SETTINGS, ResultCache(path), False)
    lines = path.read_text().splitlines()
    edited = json.loads(lines[0])
    edited["result"]["score"] = str(edited["result"]["score"])  # edited or damaged into another type
    path.write_text("\n".join([json.dumps(edited), *lines[1:]]) + "\n")
    with path.open("ab") as f:
        f.write(b'{"key": "older layout", "result": {"score": 1}}\n')
        f.write(b'{"key": "damaged \xff\xfe"}\n')
        f.write(b'{"key": "half a line')  # a run killed mid-write

    again = FakeEngine()
    assert run(again, toy_dataset(), METHODS, SETTINGS, ResultCache(path), False) == first
    # the edited row (full's, of the first example) measured again, nothing else
    assert [key for key in again.calls if key[0] == "generate"] == [("generate", "full")]
    assert again.calls[("generate", "full")] == 1
    added = run(FakeEngine(), toy_dataset(), [*METHODS, "auto"], SETTINGS, ResultCache(path), False)
    assert len(ResultCache(path).records) == len(added)  # the first record after the cut line was not glued to it


def test_a_method_added_later_runs_alone_against_recomputed_reference_logits(tmp_path):
    path = tmp_path / "r.jsonl"
    complete = run(FakeEngine(), toy_dataset(), METHODS, SETTINGS, ResultCache(tmp_path / "complete.jsonl"), False)
    run(FakeEngine(), toy_dataset(), ["full", "naive"], SETTINGS, ResultCache(path), False)

    later = FakeEngine()
    assert run(later, toy_dataset(), METHODS, SETTINGS, ResultCache(path), False) == complete
    generated = {key[1] for key in later.calls if key[0] == "generate"}
    assert generated == {"cacheblend:0.15"}
    assert later.calls[("prefill", "full")] >= 2  # full's logits, once per example (plus one warm-up)


def test_a_method_added_later_is_compared_with_full_timed_in_the_same_run(tmp_path):
    """Full's cached TTFT came from an earlier run (another load, another phase of the machine) while the added
    method was timed now: its speedup compared two runs."""
    path = tmp_path / "r.jsonl"
    run(FakeEngine(), toy_dataset(2), ["full", "naive"], SETTINGS, ResultCache(path), False)
    later = FakeEngine()
    output = later._output
    later._output = lambda method: replace(output(method), ttft=output(method).ttft * 2)  # a slower phase
    results = run(later, toy_dataset(2), METHODS, SETTINGS, ResultCache(path), False)
    summary = {s.method: s for s in aggregate(results, METHODS)}
    assert summary["cacheblend:0.15"].speedup == pytest.approx(0.8 / 0.4)  # both timed in the later run
    assert summary["cacheblend:0.15"].speedup_mean == pytest.approx(2.0)
    assert summary["naive"].speedup == pytest.approx(0.4 / 0.1)  # both from the first run, as cached
    assert summary["full"].speedup == pytest.approx(1.0)


def test_auto_runs_once_before_anything_is_timed(tmp_path):
    """An engine's first auto request measures the machine profile it lacks: in the warm-up, not a TTFT."""
    engine = FakeEngine()
    run(engine, toy_dataset(2), ["full", "naive", "auto"], SETTINGS, ResultCache(tmp_path / "r.jsonl"), False)
    assert engine.calls[("prefill", "auto")] == 2 + 1 and engine.calls[("prefill", "naive")] == 2


def test_auto_is_measured_again_on_a_resumed_run(tmp_path):
    """Its choice depends on the fidelity table and machine profile of the moment: a table built between two runs
    left the first run's rows (an exact plan, chosen for want of a table) in the report as if auto chose them."""
    path = tmp_path / "r.jsonl"
    run(FakeEngine(), toy_dataset(2), ["full", "naive", "auto"], SETTINGS, ResultCache(path), False)
    again = FakeEngine()
    run(again, toy_dataset(2), ["full", "naive", "auto"], SETTINGS, ResultCache(path), False)
    assert again.calls[("generate", "auto")] == 2 and again.calls[("generate", "naive")] == 0


def test_a_changed_setting_is_a_new_key(tmp_path):
    path = tmp_path / "r.jsonl"
    run(FakeEngine(), toy_dataset(1), METHODS, SETTINGS, ResultCache(path), False)
    engine = FakeEngine()
    changed = RunSettings(**{**SETTINGS.__dict__, "max_tokens": 16})
    run(engine, toy_dataset(1), METHODS, changed, ResultCache(path), False)
    assert engine.calls[("generate", "naive")] == 1


def test_an_example_whose_text_changed_is_measured_again(tmp_path):
    """The same file name and ids, another passage (an edited dataset, another folder's file): not the old figures."""
    path = tmp_path / "r.jsonl"
    run(FakeEngine(), toy_dataset(1), METHODS, SETTINGS, ResultCache(path), False)
    [prompt] = toy_dataset(1).prompts
    edited = Dataset("toy", "qa", [replace(prompt, chunks=["Passage 1: A\nanother text"])], 32, True)
    engine = FakeEngine()
    run(engine, edited, METHODS, SETTINGS, ResultCache(path), False)
    assert engine.calls[("generate", "naive")] == 1


def test_aggregate_per_method(tmp_path):
    results = run(FakeEngine(), toy_dataset(), METHODS, SETTINGS, ResultCache(tmp_path / "r.jsonl"), False)
    summary = {s.method: s for s in aggregate(results, METHODS)}
    assert summary["full"].examples == 2 and summary["full"].agreement == 1.0
    assert summary["naive"].speedup == pytest.approx(4.0)  # 0.4 s / 0.1 s
    assert summary["cacheblend:0.15"].speedup == pytest.approx(2.0)
    assert summary["cacheblend:0.15"].recompute_share == pytest.approx(0.15)
    assert summary["cacheblend:0.15"].agreement == pytest.approx(0.8)


def test_aggregate_ttft_statistics():
    def result(method, ttft, score):
        return MethodResult("q", method, score, 1.0, -1.0, 0.0, ttft, None, "", {})

    results = [result("full", 1.0, 0.5)] + [result("naive", t, i % 2) for i, t in enumerate([0.1, 0.2, 0.3, 0.4, 1.0])]
    naive = aggregate(results, ["full", "naive"])[1]
    assert (naive.examples, naive.score, naive.recompute_share) == (5, pytest.approx(0.4), None)
    assert naive.ttft_mean == pytest.approx(0.4) and naive.ttft_median == pytest.approx(0.3)
    assert naive.ttft_p90 == pytest.approx(0.76)  # linear interpolation between 0.4 and 1.0
    assert naive.speedup == pytest.approx(1.0 / 0.3)


def test_aggregate_counts_examples_above_the_floor_and_averages_per_example_speedups():
    def result(example, method, ttft, kl):
        return MethodResult(example, method, 0.0, 1.0, -1.0, kl, ttft, None, "", {})

    results = [result("a", "full", 1.0, 0.0), result("b", "full", 3.0, 0.0),
               result("a", "naive", 0.5, 0.2), result("b", "naive", 0.5, 0.1)]
    naive = aggregate(results, ["full", "naive"])[1]
    assert naive.above_floor == 0.5  # only a's 0.2 exceeds the default floor of 0.15
    assert naive.speedup_mean == pytest.approx((2.0 + 6.0) / 2)  # each example against its own full prefill
    assert naive.speedup == pytest.approx(2.0 / 0.5)  # the ratio of medians
    assert aggregate(results, ["full", "naive"], floor=0.05)[1].above_floor == 1.0


def test_progress_bar_names_the_example_and_method(tmp_path, capsys):
    run(FakeEngine(), toy_dataset(1), METHODS, SETTINGS, ResultCache(tmp_path / "r.jsonl"), progress=True)
    err = capsys.readouterr().err
    assert "eval toy q0: cacheblend:0.15" in err and "100%" in err
