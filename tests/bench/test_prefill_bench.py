"""`kvreuse bench prefill` plumbing: a tiny random model, two lengths, two dtypes, the vLLM peer skipped. Timings
are never asserted; that every engine and dtype is measured and every ratio comes from the samples is."""

import dataclasses

import pytest

from kvreuse.bench.prefill import above_the_floor, prompt_ids, run
from kvreuse.cli import main


@pytest.fixture(scope="module")
def rows(tiny_model_dir, tmp_path_factory):
    venv = tmp_path_factory.mktemp("prefill") / "no-venv"
    return run(str(tiny_model_dir), [48, 96], 1, ["float32", "bfloat16"], ["transformers", "vllm"], venv)


def test_every_length_and_dtype_runs_kvreuse_and_transformers(rows):
    assert [(r.tokens, r.dtype) for r in rows] == [(48, "float32"), (96, "float32"), (48, "bfloat16"),
                                                   (96, "bfloat16")]
    for row in rows:
        assert set(row.seconds) == {"kvreuse", "transformers"}  # vLLM skipped: no venv
        assert row.limit.dtype == row.dtype and row.limit.rows == row.tokens
        assert row.achieved("kvreuse") == pytest.approx(row.floor / row.seconds["kvreuse"])


def test_a_time_under_its_floor_is_named_not_shown_as_is(rows):
    """A floor measured while the machine was busy (its rate here made 100x too slow) gives achieved > 1."""
    slowed = dataclasses.replace(rows[0], floor=100 * max(rows[0].seconds.values()))
    warnings = above_the_floor([slowed])
    assert len(warnings) == 2 and all("under the floor" in w and "48 tokens in float32" in w for w in warnings)


def test_every_engine_gets_the_same_prompt_per_length():
    assert prompt_ids(64, 500).tolist() == prompt_ids(64, 500).tolist()
    assert prompt_ids(64, 500).tolist() != prompt_ids(65, 500)[:64].tolist()


def test_the_command_says_why_the_vllm_peer_is_skipped(tiny_model_dir, tmp_path, capsys):
    assert main(["bench", "prefill", "--model", str(tiny_model_dir), "--lengths", "32", "--repeats", "1",
                 "--peers", "vllm", "--vllm-venv", str(tmp_path / "none")]) == 0
    out = capsys.readouterr().out
    assert "peer vllm skipped: no vLLM venv" in out and "float32" in out


def test_a_prompt_filling_the_model_s_context_is_not_sent_to_vllm(tiny_model_dir, tmp_path, capsys):
    """vLLM refuses a prompt with no room left in the context for the token it is for: the bench says so and
    measures kvreuse alone there, instead of failing inside the peer."""
    rows = run(str(tiny_model_dir), [8192], 1, ["float32"], ["vllm"], tmp_path / "none")
    assert set(rows[0].seconds) == {"kvreuse"}
    out = capsys.readouterr().out
    assert "peer vllm: skipped [8192] tokens" in out and "at most 8191" in out and "no vLLM venv" not in out


def test_lengths_past_the_context_window_and_unknown_peers_are_refused(tiny_model_dir, capsys):
    assert main(["bench", "prefill", "--model", str(tiny_model_dir), "--lengths", "8193", "--peers", "none"]) == 2
    assert "--lengths: 8193 tokens exceed the model's context window of 8192" in capsys.readouterr().err
    assert main(["bench", "prefill", "--model", str(tiny_model_dir), "--peers", "transfomers"]) == 2
    assert "unknown peer 'transfomers'" in capsys.readouterr().err
