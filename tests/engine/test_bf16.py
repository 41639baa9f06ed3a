"""The engine in bf16 (an option, never the default): every method runs, exact reuse stays within bf16's
rounding of full prefill, and the runtime's bf16 prefill stays as near fp32 as bf16 allows on every family."""

import pytest
import torch

from kvreuse.model.runtime import LayerwiseModel

METHODS = ["full", "prefix", "naive", "cacheblend:0.3", "legolink:4", "cachetune:0.3", "guarded:1e-3"]


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p, q = reference.float().log_softmax(-1), other.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def test_bf16_prefill_stays_near_fp32(make_tiny, tiny_family):
    """Random-weight logits are peaked (KL at bf16 here: 1e-4 to 4e-3, about transformers' own bf16); a key
    masked or placed wrongly moves them by orders of magnitude more."""
    ids = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    fp32 = LayerwiseModel(make_tiny(tiny_family)).prefill(ids).logits
    bf16 = LayerwiseModel(make_tiny(tiny_family).to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16
    assert _kl(fp32, bf16.prefill(ids).logits) < 0.01


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_bf16_engine_runs_every_method(make_tiny, make_engine, rag_request, family):
    engine = make_engine(LayerwiseModel(make_tiny(family).to(torch.bfloat16)), prefix_block_size=8)
    try:
        request = rag_request(prefix=20)
        full = engine.prefill(request, "full").logits
        engine.compile(request, METHODS)
        for method in METHODS:
            out = engine.prefill(request, method)
            assert out.logits.dtype == torch.bfloat16 and bool(torch.isfinite(out.logits).all()), method
            assert out.cache.keys[0].dtype == torch.bfloat16
            if method == "prefix":  # the stored prefix restored, the rest computed: full's maths
                assert out.stats.prefix.restored_tokens > 0
                assert _kl(full, out.logits) < 1e-3
    finally:
        engine.close()
