"""Identities of a model's files, and where kvreuse caches what it derives from them.

Standard library only: the vLLM connector imports this inside vLLM's own environment, beside another transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("KVREUSE_CACHE_DIR", Path.home() / ".cache" / "kvreuse"))


def save_json(path: Path, data: object) -> Path:
    """`data` as JSON at `path` (its folder made), atomically: written to a temporary file beside it and renamed
    into place, so that a reader never sees half a file and a failure leaves the old one, and no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def fingerprint(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def config_identity(config: dict) -> str:
    """What names a model's configuration (RoPE base and scaling, norms' epsilon, ...: what its KV depends on
    beside the weights), whatever the folder it was read from and the transformers version that read it."""
    return json.dumps({k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")},
                      sort_keys=True, default=str)


def tokenizer_identity(tokenizer: str | Path, revision: str | None = None) -> str:
    """What names a tokenizer: the digest of a local directory's tokenizer files (the same files name the same
    tokenizer whatever their path), else its name and revision."""
    path = Path(tokenizer)
    files = sorted(p for p in path.glob("tokenizer*") if p.is_file()) if path.is_dir() else []
    if files:
        return fingerprint(*(file_digest(p) for p in files))
    return f"{tokenizer}@{revision or 'main'}"


def weights_identity(model_dir: Path) -> str:
    """Digest of the weight files, cached by (size, mtime) so it is computed once."""
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    stamp = json.dumps([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files])
    return _cached_digest(str(model_dir.resolve()), stamp, lambda: fingerprint(*(file_digest(f) for f in files)))


def cached_file_digest(path: Path) -> str:
    """`file_digest` of one file, cached by (size, mtime) as `weights_identity` is: a GGUF file of several GB names
    its conversion at every load (about 0.8 s a GB to hash)."""
    stat = path.stat()
    stamp = json.dumps([stat.st_size, stat.st_mtime_ns])
    return _cached_digest(fingerprint("file", str(path.resolve())), stamp, lambda: file_digest(path))


def _cached_digest(key: str, stamp: str, compute: Callable[[], str]) -> str:
    """compute(), kept under the cache folder by `key` while the files' `stamp` is unchanged."""
    cache = cache_root() / "fingerprints" / f"{fingerprint(key)}.json"
    try:
        saved = json.loads(cache.read_text())
        if saved["stamp"] == stamp:
            return str(saved["digest"])
    except (OSError, ValueError, TypeError, KeyError):  # none yet, or damaged: computed again and replaced
        pass
    digest = compute()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"stamp": stamp, "digest": digest}))
    return digest
