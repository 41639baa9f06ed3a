"""Per-family adapters: the few places where decoder families differ in what the layer loop needs.

The runtime drives the loaded `transformers` model's own modules (projections, norms, rotary embedding, MLP);
an adapter only says how to get q/k/v out of a layer and which attention window a layer uses. Everything a
family shares with Llama lives in `LlamaAdapter`.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from kvreuse.model.linear import linear


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the layer-wise runtime knows how to drive."""


class LlamaAdapter:
    """Llama, SmolLM2, TinyLlama, Llama 3 (llama3 rope scaling lives in the rotary module), Mistral, Qwen2.

    Qwen2's qkv bias needs nothing here: it is part of its `nn.Linear` projections.
    """

    def __init__(self, hf_model: nn.Module):
        self.config = hf_model.config
        self.decoder = hf_model.model
        # Each family's modeling file defines its own apply_rotary_pos_emb; use that one, not a copy of it.
        self.apply_rotary: Callable = sys.modules[type(hf_model).__module__].apply_rotary_pos_emb

    def project_qkv(self, attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normalised hidden rows [n, hidden] -> q [n, Hq, D], k [n, Hkv, D] (before RoPE), v [n, Hkv, D]."""
        head_dim = attn.head_dim
        q = linear(x, attn.q_proj).view(x.shape[0], -1, head_dim)
        k = linear(x, attn.k_proj).view(x.shape[0], -1, head_dim)
        v = linear(x, attn.v_proj).view(x.shape[0], -1, head_dim)
        return q, k, v

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of normalised rows [n, hidden]: what `mlp(x)` computes, through the runtime's `linear`."""
        return linear(mlp.act_fn(linear(x, mlp.gate_proj)) * linear(x, mlp.up_proj), mlp.down_proj)

    def sliding_window(self, layer_idx: int) -> int | None:
        """Tokens a query at layer `layer_idx` may look back over (None: the whole context)."""
        attn = self.decoder.layers[layer_idx].self_attn
        if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3 decide per layer
            return attn.sliding_window
        return getattr(self.config, "sliding_window", None)  # Mistral: one window for all layers


class Qwen3Adapter(LlamaAdapter):
    """Qwen3 normalises q and k per head before RoPE; the stored (pre-RoPE) key is the normalised one."""

    def project_qkv(self, attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(attn, x)
        return attn.q_norm(q), attn.k_norm(k), v


ADAPTERS: dict[str, type[LlamaAdapter]] = {
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "qwen3": Qwen3Adapter,
}


def adapter_for(hf_model: nn.Module) -> LlamaAdapter:
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"model architecture {model_type!r} is not supported by the layer-wise runtime; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type](hf_model)
