"""Shared fixtures: tiny random-weight models of every supported family (no downloads), the real model, and a
private redis-server on a free loopback port."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvreuse.fusion.segments import Request, Segment, SegmentKind
from kvreuse.model import native
from kvreuse.model.resolved_step import ResolvedStep
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.store.redis_server import LocalRedis, RedisServerError

TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    # a wide init makes random logits peaked, so greedy decoding is not decided by float noise
    initializer_range=0.3,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# One config per family, each exercising what sets that family apart.
TINY_CONFIGS = {
    "llama": dict(model_type="llama"),
    "llama3-rope": dict(
        model_type="llama",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "mistral-window": dict(model_type="mistral", sliding_window=24),
    "qwen2": dict(model_type="qwen2"),  # qkv bias
    "qwen3": dict(model_type="qwen3", head_dim=16),  # q/k norm
    # sliding and full layers with RoPE bases of their own, norms around attention and MLP, scaled embeddings
    "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


def make_tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    spec = dict(TINY_CONFIGS[family])
    config = AutoConfig.for_model(spec.pop("model_type"), **TINY_COMMON, **spec)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_tiny():
    """Factory for a fresh tiny model of a family, for tests that modify the model they get."""
    return make_tiny_model


@pytest.fixture(params=sorted(TINY_CONFIGS), scope="session")
def tiny_family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_family) -> torch.nn.Module:
    return make_tiny_model(tiny_family)


@pytest.fixture(scope="session")
def tiny_model(tiny_hf_model) -> LayerwiseModel:
    return LayerwiseModel(tiny_hf_model)


@pytest.fixture(scope="session")
def embedded_model():
    """The real SmolLM2-135M-Instruct, fp32 (converted from its GGUF once into the kvreuse cache folder)."""
    from kvreuse.model.loader import load_model

    return load_model(None, "float32")


def start_redis() -> LocalRedis:
    # CI installs redis-server (make system-deps); a missing server is a set-up failure, never a silent skip.
    try:
        return LocalRedis()
    except RedisServerError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def redis_server():
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def own_redis_server():
    """A server of this test's own, for tests that kill it."""
    server = start_redis()
    yield server
    server.stop()


def make_tiny_engine(model: LayerwiseModel, store=None, **options):
    """A ReuseEngine over a tiny model; requests are built from token ids directly (no tokenizer needed).
    options: ReuseEngine's keyword options (prefix_block_size, prefix_strategy)."""
    from kvreuse.engine.reuse import ReuseEngine
    from kvreuse.model.loader import LoadedModel
    from kvreuse.store.spec import open_store

    loaded = LoadedModel(model, None, "tiny", None, fingerprint="tiny-model", tokenizer_fingerprint="tiny-tok")
    return ReuseEngine(loaded, store or open_store("memory:256MB"), **options)


@pytest.fixture(scope="session")
def make_engine():
    """Factory of tiny engines, for tests that bring their own store."""
    return make_tiny_engine


@pytest.fixture
def tiny_engine(tiny_model):
    engine = make_tiny_engine(tiny_model)
    yield engine
    engine.close()


@pytest.fixture
def finished_rows(monkeypatch) -> list[tuple[int, int]]:
    """(layer, rows) each time a layer's o-projection and MLP run (`LayerwiseModel.finish_layer`, or a layer of a
    step resolved once: `ResolvedStep.run_layer`), as models run."""
    finished: list[tuple[int, int]] = []
    finish, run_layer = LayerwiseModel.finish_layer, ResolvedStep.run_layer
    monkeypatch.setattr(LayerwiseModel, "finish_layer", lambda self, layer, residual, out, int8=False:
                        finished.append((layer, residual.shape[0])) or finish(self, layer, residual, out, int8))
    monkeypatch.setattr(ResolvedStep, "run_layer", lambda self, layer, hidden:
                        finished.append((layer, hidden.shape[0])) or run_layer(self, layer, hidden))
    return finished


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_tokens(model: LayerwiseModel, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens of our runtime after `prompt_ids`, through EOS and past it."""
    result = model.prefill(prompt_ids, cache=model.new_cache(len(prompt_ids) + n))
    tokens = [int(result.logits.argmax())]
    while len(tokens) < n:
        tokens.append(int(model.decode(tokens[-1], result.cache).argmax()))
    return tokens


def out_of_memory_after(allocate, calls: Callable[[object], int]):
    """`allocate` (a method making one tensor) that raises as memory running out would once `calls(self)` tensors
    were made: a growth failing part way."""
    made = []

    def failing(self, *args):
        if len(made) == calls(self):
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        made.append(args)
        return allocate(self, *args)

    return failing


def mapping_flags(address: int, pid: int | str = "self") -> list[str]:
    """The VmFlags of the mapping holding `address` in process `pid` (its smaps): "hg" where it is advised
    MADV_HUGEPAGE."""
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def routed_as_if_amx_bf16(monkeypatch, amx: bool) -> None:
    """The runtime's choice of kernels as on a CPU with AMX-BF16 (or without), whatever this one has: there bf16
    takes the native panels for a few rows only, and torch's fused attention for more than one query."""
    built = native._built(native.library())
    monkeypatch.setattr(native, "_built", lambda lib: dataclasses.replace(built, amx_bf16=amx))


def _rag_request(prefix: int = 6, chunks: tuple[int, ...] = (30, 23, 17), fresh: int = 9) -> Request:
    segments = [Segment(SegmentKind.PREFIX, random_ids(prefix, 0))] if prefix else []
    segments += [Segment(SegmentKind.CHUNK, random_ids(n, i + 1)) for i, n in enumerate(chunks)]
    segments += [Segment(SegmentKind.FRESH, random_ids(fresh, 99))] if fresh else []
    return Request(segments)


@pytest.fixture(scope="session")
def rag_request():
    """Factory of token-id requests: [prefix] chunks... [fresh], random tokens, deterministic."""
    return _rag_request


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The embedded SmolLM2's real tokenizer (no weights loaded)."""
    from transformers import AutoTokenizer

    from kvreuse.model.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None), local_files_only=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer):
    """A tiny random-weight Llama with the embedded model's real tokenizer, saved as a Hugging Face directory,
    so commands that take `--model DIR` run end to end in seconds (plumbing only: its outputs mean nothing)."""
    tokenizer = embedded_tokenizer
    config = AutoConfig.for_model(
        "llama",
        **{
            **TINY_COMMON,
            "vocab_size": len(tokenizer),
            "num_hidden_layers": 2,
            "max_position_embeddings": 8192,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_chat_engine(tiny_model_dir):
    """A ReuseEngine over the tiny model with the real tokenizer (chat template included), in-memory store."""
    from kvreuse.engine.reuse import ReuseEngine

    engine = ReuseEngine.load(str(tiny_model_dir), "memory:256MB")
    yield engine
    engine.close()
