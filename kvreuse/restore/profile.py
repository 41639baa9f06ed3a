"""CacheFlow's threshold L_delta between layer-wise and token-wise restoration, profiled on this machine.

L_delta = min{N : T_token(N) <= T_layer(N)} over measured prefix lengths N, per model and storage tier. It is
kept in a JSON file in the kvreuse cache folder (`kvreuse profile l-delta` writes it) and read by strategy="auto".
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from kvreuse.model.loader import cache_root


def profile_path() -> Path:
    return cache_root() / "restore" / "l_delta.json"


def _entry_name(model_fingerprint: str, tier: str) -> str:
    return f"{model_fingerprint}/{tier}"


def load_all() -> dict:
    path = profile_path()
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def threshold(model_fingerprint: str, tier: str) -> int | None:
    """The profiled L_delta in tokens, or None if this model and tier were never profiled."""
    entry = load_all().get(_entry_name(model_fingerprint, tier))
    return None if entry is None else int(entry["l_delta"])


def crossover(token_seconds: dict[int, float], layer_seconds: dict[int, float]) -> int:
    """The first measured length at which token-wise is no slower than layer-wise; past the longest measured
    length if it never is (layer-wise then serves every length that was measured)."""
    for length in sorted(token_seconds):
        if token_seconds[length] <= layer_seconds[length]:
            return length
    return max(token_seconds) + 1


def save(model_fingerprint: str, tier: str, token_seconds: dict[int, float], layer_seconds: dict[int, float]
         ) -> int:
    """Record the crossover of the measured medians; returns L_delta."""
    l_delta = crossover(token_seconds, layer_seconds)
    profiles = load_all()
    profiles[_entry_name(model_fingerprint, tier)] = {
        "l_delta": l_delta,
        "token_seconds": {str(n): t for n, t in sorted(token_seconds.items())},
        "layer_seconds": {str(n): t for n, t in sorted(layer_seconds.items())},
    }
    path = profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".l_delta-")
    with os.fdopen(fd, "w") as f:
        json.dump(profiles, f, indent=1)
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return l_delta
