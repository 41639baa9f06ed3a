"""The correctness gate a model must pass before reuse methods may drive it.

On the gate's prompt (`gate_prompt_ids`: long enough for the paths real prompts take, see `gate_length`), whole:
(a) our full prefill's last-token logits match the `transformers` forward;
(b) so do they when the prompt is prefilled in two calls on one cache (a conversation's next turn; a restored
    prefix, then the rest);
on its first `core_length` tokens (past every attention window and several key tiles):
(c) greedy decoding with our KV cache reproduces greedy decoding over the `transformers` forward;
(d) sequences of different lengths decoding together in one KV pool (as the server decodes its running sequences)
    give, at every step, the logits of the `transformers` forward over each sequence;
(e) chunks prefilled alone at offset 0, their stored keys rotated to the chunks' real offsets, give exactly the
    keys of a full prefill wherever a full prefill's keys do not depend on other chunks (every layer of the
    first chunk; layer 0 of every chunk).

Beside the gate, not part of it: how far decoding over int8 weights (an option that rounds every weight, so
never exact) moves from fp32's decoding after the gate's first `core_length` tokens (`int8_decoding_drift`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvreuse.model import native
from kvreuse.model.kv_pool import KVPool
from kvreuse.model.runtime import LayerwiseModel

# Logits' largest difference from transformers', relative to their scale (the largest |logit|, at least 1): fp32
# differences in summation order grow with the model's width, and 1e-4 absolute failed a correct runtime on random
# Llamas of 1B- and 7B-class widths (1.9e-4 and 4.9e-4). Measured relative: at most 3.1e-6 on SmolLM2 and Gemma 3
# 270M, 6.6e-6 at width 2048 and 1.2e-5 at 4096; the faults the gate targets move logits by 1.5e-3 of it or more
# (docs/RESULTS.md, "The correctness gate's prompt, checks and tolerance").
LOGITS_TOLERANCE = 1e-4
# Keys a tile of the prefill attention kernel takes (native.c KEY_TILE): a later tile rescales what earlier ones
# summed, which a prompt of one tile never checks.
KEY_TILE = 64
KEYS_TOLERANCE = 1e-5  # relative to the keys' scale: see check_chunk_rerotation


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str


@torch.inference_mode()
def check_prefill_logits(model: LayerwiseModel, prompt_ids: list[int],
                         reference: torch.Tensor | None = None) -> CheckResult:
    """reference: the `transformers` forward's last logits over the prompt, if the caller has them."""
    reference = _reference_logits(model, prompt_ids)[-1] if reference is None else reference
    error = _relative_error(reference, model.prefill(prompt_ids).logits)
    return _logits_result("prefill logits vs transformers forward", error, f"{len(prompt_ids)} tokens")


@torch.inference_mode()
def check_continued_prefill(model: LayerwiseModel, prompt_ids: list[int],
                            reference: torch.Tensor | None = None) -> CheckResult:
    """The prompt's first part prefilled, then the rest on the same cache (grown past the first part's size, as a
    next turn grows it): the rest's rows must attend the cached ones. The split falls inside a key tile, whose keys
    are then partly cached and partly the rest's own. reference: as check_prefill_logits's."""
    split = min(len(prompt_ids) // 2 // KEY_TILE * KEY_TILE + KEY_TILE // 2, len(prompt_ids) - 1)
    reference = _reference_logits(model, prompt_ids)[-1] if reference is None else reference
    first = model.prefill(prompt_ids[:split])
    error = _relative_error(reference, model.prefill(prompt_ids[split:], cache=first.cache).logits)
    return _logits_result("prefill continuing a cache vs transformers forward", error,
                          f"{split} tokens cached, then {len(prompt_ids) - split}")


@torch.inference_mode()
def check_pooled_decoding(model: LayerwiseModel, prompt_ids: list[int], steps: int = 4) -> CheckResult:
    """Three sequences of different lengths and of different tokens at each position (the prompt, every 2nd and
    every 3rd of its tokens: a slot's rows read in another's place change the result), decoding together in one
    `KVPool` (the server's running sequences: one attention call per layer over the pool's slots). Each decodes its
    own last `steps` tokens, fed as they are rather than sampled, so that one `transformers` forward per sequence
    gives every step's reference."""
    sequences = [prompt_ids, prompt_ids[1::2], prompt_ids[::3]]
    pool = KVPool.for_model(model, len(sequences), max_bytes=sys.maxsize)  # a bound on growth, not an allocation
    caches = [pool.adopt(model.prefill(sequence[:-steps]).cache, len(sequence)) for sequence in sequences]
    ours = torch.stack([model.decode_batch([sequence[step - steps] for sequence in sequences], caches)
                        for step in range(steps)], dim=1)  # [sequence, step, vocab]
    error = max(_relative_error(_reference_logits(model, sequence, steps), logits)
                for sequence, logits in zip(sequences, ours))
    return _logits_result(f"pooled decoding of {len(sequences)} sequences vs transformers forward", error,
                          f"{steps} steps after {' / '.join(str(len(sequence) - steps) for sequence in sequences)} "
                          f"tokens")


def _relative_error(reference: torch.Tensor, ours: torch.Tensor) -> float:
    """The largest difference relative to the reference's scale: its largest magnitude, at least 1."""
    reference = reference.float()
    return float((ours.float() - reference).abs().max()) / max(1.0, float(reference.abs().max()))


def _logits_result(name: str, error: float, what: str) -> CheckResult:
    return CheckResult(name, error <= LOGITS_TOLERANCE,
                       f"max error {error:.1e} of the largest |logit| (tolerance {LOGITS_TOLERANCE:.0e}, {what})")


@torch.inference_mode()
def _reference_logits(model: LayerwiseModel, token_ids: list[int], last: int = 1) -> torch.Tensor:
    """The `transformers` forward's fp32 logits at the last `last` positions of `token_ids`: [last, vocab]."""
    ids = torch.tensor(token_ids, device=model.device)
    return model.hf_model(ids[None], logits_to_keep=last).logits[0].float()


@torch.inference_mode()
def check_greedy_generation(model: LayerwiseModel, prompt_ids: list[int], eos_ids: set[int],
                            new_tokens: int = 32) -> CheckResult:
    """Both sides stop at a token of `eos_ids` or after `new_tokens`; the EOS token, if reached, is part of what is
    compared. The reference is a plain argmax loop over the `transformers` forward and its own KV cache, not
    `generate`: that applies the model's generation_config (repetition_penalty, no_repeat_ngram_size, its own EOS
    list), which instruct models ship and which a runtime computing the model exactly does not apply."""
    ids = torch.tensor(prompt_ids, device=model.device)
    reference = _greedy(*_transformers_decoding(model, ids), new_tokens, eos_ids)
    prefilled = model.prefill(ids, cache=model.new_cache(len(ids) + new_tokens))
    ours = _greedy(prefilled.logits, lambda token: model.decode(token, prefilled.cache), new_tokens, eos_ids)
    agree = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    return CheckResult(
        f"greedy decoding (up to {new_tokens} tokens) vs transformers forward",
        ours == reference,
        f"identical for {agree} tokens (ours {len(ours)}, transformers {len(reference)})",
    )


def _transformers_decoding(model: LayerwiseModel,
                           ids: torch.Tensor) -> tuple[torch.Tensor, Callable[[int], torch.Tensor]]:
    """The `transformers` forward's last-token logits over `ids`, and a function decoding one more token after
    those it has seen (over the forward's own KV cache) that returns the next logits."""
    out = model.hf_model(ids[None], use_cache=True, logits_to_keep=1)

    def next_logits(token: int) -> torch.Tensor:
        nonlocal out
        out = model.hf_model(torch.tensor([[token]], device=ids.device), past_key_values=out.past_key_values,
                             use_cache=True)
        return out.logits[0, -1]

    return out.logits[0, -1], next_logits


def _greedy(logits: torch.Tensor, next_logits: Callable[[int], torch.Tensor], new_tokens: int,
            eos_ids: set[int]) -> list[int]:
    """Greedy tokens from the prompt's last logits (the engine's sampler sits above the model layer); the EOS token,
    if reached, is the last one."""
    tokens = [int(logits.argmax())]
    while len(tokens) < new_tokens and tokens[-1] not in eos_ids:
        tokens.append(int(next_logits(tokens[-1]).argmax()))
    return tokens


@torch.inference_mode()
def check_chunk_rerotation(model: LayerwiseModel, prompt_ids: list[int], num_chunks: int = 3) -> CheckResult:
    full = model.prefill(prompt_ids)
    bounds = torch.linspace(0, len(prompt_ids), num_chunks + 1).long().tolist()
    errors_first, errors_layer0 = [], []
    for start, end in zip(bounds, bounds[1:]):
        alone = model.prefill(prompt_ids[start:end], capture_kv=True)  # at positions 0..n-1
        rotary = model.rotary(torch.arange(start, end))
        for layer in range(model.num_layers if start == 0 else 1):
            placed, reference = model.rope(layer, alone.keys[layer], rotary), full.cache.keys[layer][start:end]
            # Relative to the keys' own scale (at least 1): float32 rounding of keys in the hundreds, as Gemma 3's
            # are, differs by more than 1e-4 between two prefills of different lengths.
            error = _relative_error(reference, placed)
            (errors_first if start == 0 else errors_layer0).append(error)
    error = max(errors_first + errors_layer0)
    return CheckResult(
        "chunk keys re-rotated to their offsets vs full prefill",
        error <= KEYS_TOLERANCE,
        f"max error {error:.2e} relative to the keys' scale (tolerance {KEYS_TOLERANCE:.0e}; first chunk all "
        f"layers, {num_chunks - 1} later chunks at layer 0)",
    )


def core_length(model: LayerwiseModel) -> int:
    """Tokens the gate's checks run on, but for the two prefills of its whole prompt: past several of the prefill
    attention kernel's key tiles and every layer's attention window (Gemma 3's sliding layers see 512 tokens)."""
    windows = [window for window in model.windows if window is not None]
    return max([8 * KEY_TILE, *windows]) + 16


def gate_length(model: LayerwiseModel) -> int:
    """The fewest tokens of the gate's prompt, which its prefill checks take whole: past `core_length` and the rows
    products of the model's dtype take through native's panels (`native.most_panel_rows`: 2048 with AVX2, 1024 for
    bf16 with AVX-512, 32 where the CPU has AMX; oneDNN takes more), so that both kinds of product are checked
    (fp32 with AVX-512 and AMX takes the panels for any rows: one kind). The other checks take its first `core_length`
    tokens: on the whole prompt they took the gate from 12.6 s to 19.5 s on SmolLM2 here, and the re-rotated keys
    would compare products through oneDNN with products in panels (fp32 rounding of 8.8e-6 of the keys' scale at
    width 4096, against KEYS_TOLERANCE 1e-5; docs/RESULTS.md)."""
    most = native.most_panel_rows(model.dtype)
    return core_length(model) if most == native.ANY_ROWS else max(core_length(model), most + 16)


def gate_prompt_ids(model: LayerwiseModel, encode: Callable[[str], list[int]], text: str) -> list[int]:
    """`text` repeated until it runs past `gate_length` tokens."""
    repeated = text
    while len(ids := encode(repeated)) <= gate_length(model):
        repeated += " " + text
    return ids


@torch.inference_mode()
def int8_decoding_drift(model: LayerwiseModel, prompt_ids: list[int], new_tokens: int = 32) -> str:
    """fp32's greedy tokens decoded again over int8 weights (LayerwiseModel.decode_in_int8), each step fed fp32's
    token: on how many steps int8's top token is fp32's, and the largest logit difference. A figure for a user
    choosing `--decode-weights int8`, not a pass or fail."""
    try:
        model.decode_in_int8()
    except ValueError as e:
        return f"not available: {e}"
    model.decode_in_int8(False)
    ids = torch.tensor(prompt_ids)
    fp32 = model.prefill(ids, cache=model.new_cache(len(ids) + new_tokens))
    int8_cache = fp32.cache.clone()
    tokens, fp32_logits = [int(fp32.logits.argmax())], []
    for _ in range(new_tokens - 1):
        fp32_logits.append(model.decode(tokens[-1], fp32.cache))
        tokens.append(int(fp32_logits[-1].argmax()))
    model.decode_in_int8()
    try:
        int8_logits = [model.decode(token, int8_cache) for token in tokens[:-1]]
    finally:
        model.decode_in_int8(False)
    same = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(fp32_logits, int8_logits))
    largest = max(float((a - b).abs().max()) for a, b in zip(fp32_logits, int8_logits))
    return (f"decoding over int8 weights (--decode-weights int8, an option): fp32's top token on {same} of "
            f"{len(fp32_logits)} steps fed fp32's tokens; largest logit difference {largest:.3f}")


def run_gate(model: LayerwiseModel, prompt_ids: list[int], eos_ids: set[int],
             new_tokens: int = 32) -> list[CheckResult]:
    """eos_ids: the tokens greedy decoding stops at on both sides (the engine's: `engine.generate.eos_token_ids`)."""
    if model.dtype != torch.float32:
        raise ValueError(f"the correctness gate runs in float32; this model is loaded as {model.dtype}")
    reference = _reference_logits(model, prompt_ids)[-1]  # one forward over the prompt for both prefill checks
    core = prompt_ids[:core_length(model)]
    return [
        check_prefill_logits(model, prompt_ids, reference),
        check_continued_prefill(model, prompt_ids, reference),
        check_greedy_generation(model, core, eos_ids, new_tokens),
        check_pooled_decoding(model, core),
        check_chunk_rerotation(model, core),
    ]
