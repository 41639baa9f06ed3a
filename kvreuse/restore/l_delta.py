"""CacheFlow's threshold L_delta between layer-wise and token-wise restoration, profiled on this machine.

L_delta = min{N : T_layer(N) >= (1 - MARGIN) T_token(N)} over measured prefix lengths N, per model and storage
tier: layer-wise serves the lengths below it, where it measured faster by more than the margin. It is kept in a
JSON file in the kvreuse cache folder (`kvreuse profile l-delta` writes it) and read by strategy="auto".
"""

from __future__ import annotations

import json
from pathlib import Path

from kvreuse.model.identity import cache_root, save_json


def profile_path() -> Path:
    return cache_root() / "restore" / "l_delta.json"


def _entry_name(model_fingerprint: str, tier: str) -> str:
    return f"{model_fingerprint}/{tier}"


def load_all() -> dict:
    """Every saved profile; a missing or unreadable file holds none (the next save replaces it)."""
    try:
        profiles = json.loads(profile_path().read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return profiles if isinstance(profiles, dict) else {}


def threshold(model_fingerprint: str, tier: str) -> int | None:
    """The profiled L_delta in tokens, or None if this model and tier were never profiled (or their entry is
    not one this module wrote)."""
    entry = load_all().get(_entry_name(model_fingerprint, tier))
    try:
        return int(entry["l_delta"])
    except (TypeError, KeyError, ValueError):
        return None


# Layer-wise must beat token-wise by more than this share of its time. Where neither side computes, the two axes
# do the same loads, and on this machine their medians then differed by up to 6% run to run (the restore
# benchmark's cake / load-only column): a closer call is noise, and token-wise reads fewer, larger pieces.
MARGIN = 0.05


def crossover(token_seconds: dict[int, float], layer_seconds: dict[int, float]) -> int:
    """The first measured length at which layer-wise is not faster than token-wise by more than MARGIN; past the
    longest measured length if it always is (layer-wise then serves every length that was measured)."""
    for length in sorted(token_seconds):
        if layer_seconds[length] >= (1 - MARGIN) * token_seconds[length]:
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
    save_json(profile_path(), profiles)
    return l_delta
