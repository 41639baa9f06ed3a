"""The vLLM peer's process: started in the environment the user set, not the one kvreuse set for itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.bench.peers import vllm_peer


class _Started(Exception):
    """Raised in place of starting vLLM, once its environment has been seen."""


def test_vllm_runs_without_the_onednn_capacities_kvreuse_set_but_with_the_user_s(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_peer, "ONEDNN_CAPACITIES_SET", ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",))
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")  # kvreuse's own, for its products only
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "99")  # the user's
    seen = {}

    def run(command, *, env, **kwargs):
        seen.update(env)
        raise _Started

    monkeypatch.setattr(vllm_peer.subprocess, "run", run)
    settings = vllm_peer.VllmSettings(tmp_path / "venv", Path("model"), 256, threads=2)
    with pytest.raises(_Started):
        vllm_peer._run_job(settings, "full", {}, 1)
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in seen and seen["LRU_CACHE_CAPACITY"] == "99"
    assert seen["OMP_NUM_THREADS"] == "2"
