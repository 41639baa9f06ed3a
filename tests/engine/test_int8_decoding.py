"""The engine loaded to decode over int8 weights (`decode_weights="int8"`, the serve and generate commands'
`--decode-weights int8`): an option, never the default, refused by name for what it cannot decode."""

import pytest
import torch

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.engine.sampling import SamplingParams
from kvreuse.model import native

pytestmark = pytest.mark.skipif(not native.panels_take(torch.float32), reason="needs the native kernels")


def test_an_engine_loaded_for_int8_decodes_over_int8_weights(tiny_model_dir, tiny_chat_engine, monkeypatch):
    from kvreuse.model import runtime

    engine = ReuseEngine.load(str(tiny_model_dir), "memory:64MB", decode_weights="int8")
    try:
        assert engine.model.int8_decoding and not tiny_chat_engine.model.int8_decoding  # not the default
        lm_heads, linear_int8 = [], runtime.linear_int8
        monkeypatch.setattr(runtime, "linear_int8", lambda *a: lm_heads.append(1) or linear_int8(*a))
        request = engine.build_request(["A document about the sea."], "What is it about?")
        out = engine.generate(request, "full", SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(out.token_ids) == 5 and len(lm_heads) == 4  # every token after the first
    finally:
        engine.close()


def test_unknown_decode_weights_are_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="decode weights 'int4'"):
        ReuseEngine.load(str(tiny_model_dir), "memory:64MB", decode_weights="int4")
    with pytest.raises(ValueError, match="fp32 model"):
        ReuseEngine.load(str(tiny_model_dir), "memory:64MB", dtype="bfloat16", decode_weights="int8")
