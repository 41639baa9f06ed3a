"""The transformers peer's prefix reuse (copied DynamicCache, suffix prefilled) gives full prefill's logits."""

import torch

from kvreuse.bench.peers.transformers_peer import FULL, PREFIX, transformers_variants
from kvreuse.bench.workload import Shape, Workload


def test_prefix_reuse_matches_full_prefill_and_leaves_the_prefix_cache_intact(tiny_hf_model, rag_request):
    workload = Workload(Shape(85, 3), 0, rag_request())
    with torch.inference_mode():  # as the bench runs it
        variants = transformers_variants(tiny_hf_model, workload)
        full = variants[FULL]()
        first, second = variants[PREFIX](), variants[PREFIX]()  # a second request reuses the same prefix cache
    torch.testing.assert_close(first, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second, first)
