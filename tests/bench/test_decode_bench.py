"""`kvreuse bench decode` plumbing on a tiny random model, the vLLM peer skipped: every batch size and dtype is
measured, and a step decodes every sequence of the batch."""

import pytest

from kvreuse.bench.decode import WARM_UP_STEPS, _kvreuse_steps, _prefill, prompts_of, run
from kvreuse.cli import main


def test_every_batch_and_dtype_is_measured(tiny_model_dir, tmp_path):
    rows = run(str(tiny_model_dir), [1, 3], 24, 4, 1, ["float32", "bfloat16"], ["vllm"], tmp_path / "no-venv")
    assert [(r.batch, r.dtype) for r in rows] == [(1, "float32"), (3, "float32"), (1, "bfloat16"), (3, "bfloat16")]
    for row in rows:  # int8 weights: an fp32 model's decoding only
        int8 = {"int8 weights"} if row.dtype == "float32" else set()
        assert set(row.step_seconds) == {"kvreuse", "own caches", "torch kernels"} | int8
        assert row.tokens_per_second("kvreuse") == pytest.approx(row.batch / row.step_seconds["kvreuse"])
        assert row.floor > 0 and row.achieved("kvreuse") == pytest.approx(row.floor / row.step_seconds["kvreuse"])
    assert rows[1].floor > rows[0].floor  # more sequences read more KV


def test_the_torch_kernels_step_runs_with_the_native_kernels_off_and_int8_over_int8_weights(tiny_model_dir, tmp_path,
                                                                                           monkeypatch):
    from kvreuse.bench import decode as decode_bench
    from kvreuse.model import native

    seen = []
    steps = decode_bench._kvreuse_steps
    monkeypatch.setattr(decode_bench, "_kvreuse_steps", lambda model, *args, **kwargs: seen.append(
        (native.available(), model.int8_decoding)) or steps(model, *args, **kwargs))
    run(str(tiny_model_dir), [2], 16, 2, 3, ["float32"], [], tmp_path / "no-venv")
    built = native.library() is not None
    turn = [(built, False)] * 2 + [(False, False)] + ([(True, True)] if built else [])
    turns = [seen[i : i + len(turn)] for i in range(0, len(seen), len(turn))]
    assert len(turns) == 3 and all(sorted(t) == sorted(turn) for t in turns)
    assert len({tuple(t) for t in turns}) > 1  # in another order each turn: none always runs after the same one


@pytest.mark.parametrize("pooled", [True, False])
def test_each_timed_step_decodes_every_sequence_of_the_batch(tiny_model, pooled):
    prompts = prompts_of(3, 20, 256)
    assert len({tuple(p) for p in prompts}) == 3 and prompts == prompts_of(3, 20, 256)
    calls = []
    decode = tiny_model.decode_batch

    def counted(tokens, caches):
        calls.append((len(tokens), [c.length for c in caches], {c.pool is not None for c in caches}))
        return decode(tokens, caches)

    prefilled = _prefill(tiny_model, prompts, WARM_UP_STEPS + 5 + 1)
    tiny_model.decode_batch = counted
    try:
        seconds = _kvreuse_steps(tiny_model, prefilled, steps=5, pooled=pooled)
        again = _kvreuse_steps(tiny_model, prefilled, steps=5, pooled=pooled)
    finally:
        del tiny_model.decode_batch
    assert len(seconds) == len(again) == 5 and len(calls) == 2 * (5 + 3)  # warm-up steps are not timed
    assert [n for n, _, _ in calls] == [3] * 16
    assert calls[7][1] == calls[-1][1] == [20 + 8 - 1] * 3  # every cache grew by one row per step, both times
    assert [r.cache.length for r in prefilled] == [20] * 3  # each run decodes from copies of the prefills
    assert all(in_pool == {pooled} for _, _, in_pool in calls)


def test_the_command_runs(tiny_model_dir, tmp_path, capsys):
    assert main(["bench", "decode", "--model", str(tiny_model_dir), "--batches", "2", "--prompt-tokens", "16",
                 "--steps", "3", "--repeats", "1", "--vllm-venv", str(tmp_path / "none")]) == 0
    out = capsys.readouterr().out
    assert "peer vllm skipped" in out and "kvreuse ms/step" in out and "kvreuse achieved / limit" in out


def test_positions_past_the_context_window_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="exceed the model's context window of 8192"):
        run(str(tiny_model_dir), [1], 8190, 4, 1, ["float32"], [], tmp_path)


def test_a_batch_the_kv_pool_cannot_hold_is_refused_not_timed_on_its_own_caches(tiny_model, monkeypatch):
    import kvreuse.bench.decode as decode

    monkeypatch.setattr(decode, "DEFAULT_POOL_BYTES", 1 << 16)
    prefilled = _prefill(tiny_model, prompts_of(2, 64, tiny_model.config.vocab_size), WARM_UP_STEPS + 3)
    with pytest.raises(ValueError, match="do not fit the KV pool"):
        _kvreuse_steps(tiny_model, prefilled, 2, pooled=True)
