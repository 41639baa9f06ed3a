"""The vLLM runner's arithmetic, outside vLLM's venv (vLLM itself runs in the connector's and benches' runs)."""

import pytest

from kvreuse.bench.peers.vllm_runner import decode_step_seconds


def test_vllm_s_decoding_step_is_each_sequence_s_time_per_output_token():
    """A batch prefilled in one step (every sequence's first token at 1.0), then decoded: 0.1 s a step, one poll
    seeing two steps at once; a sequence that never got past its first token is not a sequence that decoded."""
    events = [(1.0, "a", 1), (1.0, "b", 1), (1.0, "c", 1), (1.1, "a", 2), (1.1, "b", 2), (1.3, "a", 4),
              (1.3, "b", 4)]
    assert decode_step_seconds(events) == pytest.approx([0.1, 0.1])
    assert decode_step_seconds([]) == []
