from __future__ import annotations

import numpy as np
import pytest

from kvreuse.store.keys import InvalidKey, KeySpace, check_key, chunk_key, compile_mode, prefix_block_keys

SPACE = KeySpace("llama/abc123/float32", "tok/def456")


def test_chunk_key_is_stable_across_runs_and_input_types():
    # Golden value: keys must not change between versions, or every stored entry becomes unreachable.
    assert chunk_key([1, 2, 3], SPACE) == "852b97a133c39bacd238b55b3ff968b3c51377953ab5c91682cb21d5a7a56ca4"
    assert chunk_key([1, 2, 3], SPACE) == chunk_key(np.array([1, 2, 3], dtype=np.int32), SPACE)
    assert len(chunk_key([1, 2, 3], SPACE)) == 64


@pytest.mark.parametrize("other", [
    KeySpace("llama/abc123/bfloat16", "tok/def456"),
    KeySpace("llama/abc123/float32", "tok/other"),
    KeySpace("llama/abc123/float32", "tok/def456", salt="tenant"),
    KeySpace("llama/abc123/float32", "tok/def456", salt=""),
    KeySpace("llama/abc123/float32", "tok/def456", compile_mode=compile_mode(4)),
])
def test_everything_that_changes_the_kv_changes_the_key(other):
    assert chunk_key([1, 2, 3], other) != chunk_key([1, 2, 3], SPACE)


def test_token_changes_and_field_boundaries_change_the_key():
    assert chunk_key([1, 2, 3], SPACE) != chunk_key([1, 2, 4], SPACE)
    assert chunk_key([1, 2, 3], SPACE) != chunk_key([1, 2, 3, 0], SPACE)
    assert chunk_key([1], KeySpace("ab", "c")) != chunk_key([1], KeySpace("a", "bc"))


def test_prefix_block_keys_chain():
    tokens = list(range(1000))
    keys = prefix_block_keys(tokens, 256, space=SPACE)
    assert len(keys) == 3  # the trailing 232 tokens make no full block
    assert len(prefix_block_keys(tokens, 256, space=SPACE, partial=True)) == 4
    # A longer prompt with the same start shares the leading blocks' keys.
    assert prefix_block_keys(tokens + [7] * 100, 256, space=SPACE)[:3] == keys
    # Block j's key depends on every earlier block: change token 0, and every key changes.
    changed = prefix_block_keys([9999] + tokens[1:], 256, space=SPACE)
    assert all(a != b for a, b in zip(keys, changed, strict=True))
    # The same tokens as a chunk and as a prefix block are different entries.
    assert keys[0] != chunk_key(tokens[:256], SPACE)
    assert prefix_block_keys(tokens, 100, space=SPACE)[0] != keys[0]


def test_a_partial_block_s_key_is_not_a_whole_block_s():
    tokens = list(range(10))
    partial = prefix_block_keys(tokens[:6], 4, space=SPACE, partial=True)
    assert partial[0] == prefix_block_keys(tokens, 4, space=SPACE)[0]  # the whole block before it: the same
    assert partial[1] not in prefix_block_keys(tokens[:8], 4, space=SPACE)
    assert partial[1] != prefix_block_keys(tokens[:7], 4, space=SPACE, partial=True)[1]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="block_size"):
        prefix_block_keys([1], 0, space=SPACE)
    with pytest.raises(ValueError, match="one-dimensional"):
        chunk_key([[1, 2]], SPACE)
    with pytest.raises(ValueError, match="dummy_tokens"):
        compile_mode(-1)
    with pytest.raises(InvalidKey, match="'../x'"):
        check_key("../x")
    assert compile_mode(0) == "plain" and compile_mode(3) == "legolink0:3"
