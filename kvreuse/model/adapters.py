"""Per-family adapters: the few places where decoder families differ in what the layer loop needs.

The runtime drives the loaded `transformers` model's own modules (projections, norms, rotary embedding, MLP);
an adapter says how to get q/k/v out of a layer, how the layer ends (norms, MLP), which RoPE and attention window
a layer uses. Everything a family shares with Llama lives in `LlamaAdapter`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kvreuse.model import native
from kvreuse.model.linear import in_panels, int8_panels, linear
from kvreuse.model.resolved_step import LayerWeights

# Bytes of the gate and up products' output (2 x intermediate values a row) one pass through the MLP makes: more
# rows run in passes of this many bytes, so that the activation and the down product read that output from the
# last-level cache, not memory. On a 2-core Zen 4 EPYC (32 MB L3), SmolLM2's fp32 prefill of 8192 tokens ran
# 1.03x faster in passes of 2048 rows, of 4096 tokens 1.00-1.02x (its MLP 1.02x); 2048 rows are one pass.
MLP_PASS_BYTES = 24 << 20
# Rows counts whose resolved layers `LlamaAdapter.native_layers` keeps at once (a decoding step's and a few
# prompts'); one more starts the set afresh.
NATIVE_LAYERS_KEPT = 8
UNRESOLVED = object()  # a key `native_layers` has not resolved (None is a resolved answer: not native)
# Norms computing weight * x / rms(x) as Llama's does (each family's own copy of the class), which the native kernel
# runs in one pass; any other norm (Gemma's 1 + weight, for one) runs as its module.
PLAIN_RMS_NORMS = (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)
SILU = (nn.SiLU, SiLUActivation)


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the layer-wise runtime knows how to drive."""


class LlamaAdapter:
    """Llama, SmolLM2, TinyLlama, Llama 3 (llama3 rope scaling lives in the rotary module), Qwen2; Mistral with its
    window (`MistralAdapter`).

    Qwen2's qkv bias needs nothing here: it is part of its `nn.Linear` projections.
    """

    def __init__(self, hf_model: nn.Module):
        self.config = hf_model.config
        self.decoder = hf_model.model
        # `native_layers` by what they depend on besides the weights, kept while the parameters of the layers'
        # modules (as loaded) are the tensors, at the versions, they were resolved from
        self._modules_with_weights = [m for m in self.decoder.layers.modules() if m._parameters]
        self._native_layers: dict[tuple, list[LayerWeights] | None] = {}
        self._native_layers_of: tuple[list[torch.Tensor], list[int | None]] = ([], [])

    def products(self, block: nn.Module) -> list[tuple[nn.Linear, ...]]:
        """A layer's projections as the runtime runs them: those that take the same input stacked into one
        product (kvreuse.model.linear)."""
        attn, mlp = block.self_attn, block.mlp
        return [_qkv(attn), (attn.o_proj,), _gate_up(mlp), (mlp.down_proj,)]

    def project_qkv(self, block: nn.Module, hidden: torch.Tensor, int8: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden rows [n, hidden] entering `block` -> q [n, Hq, D], k [n, Hkv, D] (before RoPE), v [n, Hkv, D]:
        views of one product of the normalised rows (one native call for both where it runs); `int8`: over the
        weights in int8 (decoding rows of a model decoding in int8)."""
        attn, norm = block.self_attn, block.input_layernorm
        projections = _qkv(attn)
        panels = in_panels(hidden, *projections) if self._norm_runs_native(norm, hidden) and not int8 else None
        if panels is not None and native.parts_take(hidden, hidden.shape[1]):
            product = native.normed_panel_rows(hidden, norm.weight, norm.variance_epsilon, panels)
        else:
            product = linear(self.norm(norm, hidden), *projections, int8=int8)
        qkv = product.split([p.out_features for p in projections], -1)
        return tuple(part.view(hidden.shape[0], -1, attn.head_dim) for part in qkv)

    def mlp(self, mlp: nn.Module, x: torch.Tensor, plus: torch.Tensor | None = None, int8: bool = False
            ) -> torch.Tensor:
        """The gated MLP of normalised rows [n, hidden]: what `mlp(x)` computes, through the runtime's `linear`
        (`plus` added to its output, as `linear` adds it; `int8`: as `linear` takes it), in passes of at most
        MLP_PASS_BYTES of intermediate values."""
        rows = _pass_rows(mlp, x)
        if x.shape[0] <= rows:
            return self._mlp_pass(mlp, x, plus, int8)
        return torch.cat([self._mlp_pass(mlp, x[s : s + rows], None if plus is None else plus[s : s + rows], int8)
                          for s in range(0, x.shape[0], rows)])

    def _mlp_pass(self, mlp: nn.Module, x: torch.Tensor, plus: torch.Tensor | None, int8: bool) -> torch.Tensor:
        gate, up = linear(x, *_gate_up(mlp), int8=int8).split(mlp.gate_proj.out_features, -1)
        if isinstance(mlp.act_fn, SILU) and native.runs_fp32_or_bf16(gate):
            return linear(native.silu_mul(gate, up), mlp.down_proj, plus=plus, int8=int8)
        # in place: one buffer fewer to allocate and fill
        return linear(mlp.act_fn(gate).mul_(up), mlp.down_proj, plus=plus, int8=int8)

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`norm(x)` for rows [n, hidden]: in the native kernel when it is Llama's RMSNorm."""
        if self._norm_runs_native(norm, x):
            return native.rms_norm(x, norm.weight, norm.variance_epsilon)
        return norm(x)

    @staticmethod
    def _norm_runs_native(norm: nn.Module, x: torch.Tensor) -> bool:
        return isinstance(norm, PLAIN_RMS_NORMS) and native.runs_fp32_or_bf16(x, norm.weight)

    def finish_layer(self, block: nn.Module, residual: torch.Tensor, attn_out: torch.Tensor, int8: bool = False
                     ) -> torch.Tensor:
        """Output projection, residual, post-attention norm and MLP of the attended rows: one native call where
        every product runs in panels and the MLP in one pass (`native.layer_end`, to the bit the same); `int8`:
        as `project_qkv` takes it."""
        attn, mlp, norm = block.self_attn, block.mlp, block.post_attention_layernorm
        if (not int8 and isinstance(mlp.act_fn, SILU) and self._norm_runs_native(norm, attn_out)
                and attn_out.shape[0] <= _pass_rows(mlp, attn_out)):
            o_proj, gate_up, down = (in_panels(attn_out, *layers) for layers in ((attn.o_proj,), _gate_up(mlp),
                                                                                (mlp.down_proj,)))
            if (o_proj is not None and gate_up is not None and down is not None
                    and native.parts_take(attn_out, attn_out.shape[1], residual.shape[1],
                                          mlp.down_proj.in_features)):
                return native.layer_end(attn_out.contiguous(), residual.contiguous(), o_proj, norm.weight,
                                        norm.variance_epsilon, gate_up, down)
        hidden = linear(attn_out, attn.o_proj, plus=residual, int8=int8)
        return self.mlp(mlp, self.norm(norm, hidden), plus=hidden, int8=int8)

    def native_layers(self, rows: int, dtype: torch.dtype, int8: bool = False) -> list[LayerWeights] | None:
        """Every layer's `native_layer` for a step of `rows` rows of `dtype` (over int8 weights if `int8`), or None if
        a layer's do not run there.
        Kept between steps while the parameters are unchanged (one pass over them, about 0.1 ms for SmolLM2, where
        resolving the 30 layers took 0.8 ms of a 20 ms decoding step) and the limits those checks read are the same."""
        tensors = [t for module in self._modules_with_weights for t in module._parameters.values() if t is not None]
        versions = [None if t.is_inference() else t._version for t in tensors]
        known, known_versions = self._native_layers_of
        if versions != known_versions or len(tensors) != len(known) or any(a is not b for a, b in zip(tensors, known)):
            self._native_layers.clear()
            self._native_layers_of = tensors, versions
        key = (rows, dtype, int8, native.most_panel_rows(dtype), MLP_PASS_BYTES)
        # one look-up, not a test and a read: steps in other threads (a batch restoration's) may clear the set
        kept = self._native_layers.get(key, UNRESOLVED)
        if kept is UNRESOLVED:
            if len(self._native_layers) >= NATIVE_LAYERS_KEPT:  # prompts of many lengths: keep the latest few
                self._native_layers.clear()
            probe = torch.empty(rows, self.config.hidden_size, dtype=dtype)
            weights = [self.native_layer(block, probe, int8) for block in self.decoder.layers]
            kept = self._native_layers[key] = None if any(w is None for w in weights) else weights
        return kept

    def native_layer(self, block: nn.Module, rows: torch.Tensor, int8: bool = False) -> LayerWeights | None:
        """The layer's norms and products as the native kernels take them for rows like `rows` (`ResolvedStep`), its
        products over its weights in int8 if `int8` (fp32 rows), or None where `project_qkv` or `finish_layer`
        would not run them as one native call each."""
        attn, mlp, norms = block.self_attn, block.mlp, (block.input_layernorm, block.post_attention_layernorm)
        if not (isinstance(mlp.act_fn, SILU) and all(self._norm_runs_native(norm, rows) for norm in norms)
                and rows.shape[0] <= _pass_rows(mlp, rows)):
            return None
        qkv, o_proj, gate_up, down = (int8_panels(*layers) if int8 else in_panels(rows, *layers)
                                      for layers in (_qkv(attn), (attn.o_proj,), _gate_up(mlp), (mlp.down_proj,)))
        if (qkv is None or o_proj is None or gate_up is None or down is None
                or not native.parts_take(rows, rows.shape[1], o_proj.in_features, down.in_features)):
            return None
        return LayerWeights(norms[0].weight, norms[0].variance_epsilon, qkv, o_proj, norms[1].weight,
                            norms[1].variance_epsilon, gate_up, down)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def rope_kinds(self) -> list[str | None]:
        """The kinds of RoPE the layers use, as the model's rotary module takes them (None: it takes no kind)."""
        return [None]

    def rope_kind(self, layer_idx: int) -> str | None:
        return None

    def sliding_window(self, layer_idx: int) -> int | None:
        """Tokens a query at layer `layer_idx` may look back over (None: the whole context): the window the family's
        own attention applies. Qwen2, Qwen3 and Gemma 3 set it per layer on the attention module; Llama has none,
        whatever a config.json holds (a stray `sliding_window` key stays an attribute its modelling code never
        reads)."""
        return getattr(self.decoder.layers[layer_idx].self_attn, "sliding_window", None)


class MistralAdapter(LlamaAdapter):
    """Mistral: Llama's layers, whose attention reads one window for every layer from the config."""

    def sliding_window(self, layer_idx: int) -> int | None:
        return getattr(self.config, "sliding_window", None)


def _pass_rows(mlp: nn.Module, x: torch.Tensor) -> int:
    """The most rows of x an MLP pass takes (MLP_PASS_BYTES)."""
    return max(1, MLP_PASS_BYTES // (2 * mlp.gate_proj.out_features * x.element_size()))


def _qkv(attn: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    return attn.q_proj, attn.k_proj, attn.v_proj


def _gate_up(mlp: nn.Module) -> tuple[nn.Linear, nn.Linear]:
    return mlp.gate_proj, mlp.up_proj


class Qwen3Adapter(LlamaAdapter):
    """Qwen3 normalises q and k per head before RoPE; the stored (pre-RoPE) key is the normalised one."""

    def project_qkv(self, block: nn.Module, hidden: torch.Tensor, int8: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(block, hidden, int8)
        return block.self_attn.q_norm(q), block.self_attn.k_norm(k), v

    def native_layer(self, block: nn.Module, rows: torch.Tensor, int8: bool = False) -> LayerWeights | None:
        return None  # q and k are normalised between the product and RoPE, which the resolved calls do not do


class Gemma3Adapter(Qwen3Adapter):
    """Gemma 3: q/k norm as Qwen3; norms after attention and around the MLP as well as before; sliding-window
    layers (their window set per layer) rotating by a base of their own; the embedding scale is part of its
    embedding module."""

    def __init__(self, hf_model: nn.Module):
        super().__init__(hf_model)
        if getattr(self.config, "attn_logit_softcapping", None) is not None:  # Gemma 2's; the fused kernel has none
            raise UnsupportedModelError("attention logit soft-capping is not supported by the layer-wise runtime")
        # EmbeddingGemma's: a query also sees later tokens (within a window), which attention by position never lets
        # it (causal by construction)
        if getattr(self.config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("bidirectional attention (use_bidirectional_attention) is not supported by "
                                        "the layer-wise runtime, which attends causally")

    def finish_layer(self, block: nn.Module, residual: torch.Tensor, attn_out: torch.Tensor, int8: bool = False
                     ) -> torch.Tensor:
        hidden = residual + block.post_attention_layernorm(linear(attn_out, block.self_attn.o_proj, int8=int8))
        mlp_out = self.mlp(block.mlp, block.pre_feedforward_layernorm(hidden), int8=int8)
        return hidden + block.post_feedforward_layernorm(mlp_out)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def rope_kinds(self) -> list[str | None]:
        return sorted(set(self.config.layer_types))

    def rope_kind(self, layer_idx: int) -> str | None:
        return self.config.layer_types[layer_idx]


ADAPTERS: dict[str, type[LlamaAdapter]] = {
    "llama": LlamaAdapter,
    "mistral": MistralAdapter,
    "qwen2": LlamaAdapter,
    "qwen3": Qwen3Adapter,
    "gemma3_text": Gemma3Adapter,
}


def adapter_for(hf_model: nn.Module) -> LlamaAdapter:
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"model architecture {model_type!r} is not supported by the layer-wise runtime; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type](hf_model)
