"""Hugging Face `transformers` as a peer: its full prefill, and its own prefix reuse with a copied cache.

Prefix reuse is the pattern transformers documents for a shared prompt prefix: compute the prefix's
DynamicCache once, deep-copy it for every request (a forward pass extends the cache in place), and prefill only
the rest of the prompt.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from kvreuse.bench.workload import Workload

FULL, PREFIX = "transformers:full", "transformers:prefix"


def transformers_variants(hf_model: torch.nn.Module, workload: Workload) -> dict[str, Callable[[], torch.Tensor]]:
    """Timed calls returning first-token logits; the prefix cache is computed here, outside any timing."""
    prompt = torch.tensor([workload.prompt_ids])
    prefix_rows = len(workload.exact_prefix_ids)
    prefix_cache = hf_model(prompt[:, :prefix_rows], use_cache=True).past_key_values
    suffix = prompt[:, prefix_rows:]

    def full() -> torch.Tensor:
        # logits_to_keep=1: the first token needs the last row's logits only, as generate() computes them
        return hf_model(prompt, use_cache=True, logits_to_keep=1).logits[0, -1]

    def with_prefix() -> torch.Tensor:
        cache = copy.deepcopy(prefix_cache)
        return hf_model(suffix, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]

    return {FULL: full, PREFIX: with_prefix}
