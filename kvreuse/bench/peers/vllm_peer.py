"""vLLM on CPU as a peer, run in a virtual environment of its own (benchmarks/peers/setup_vllm.sh installs it).

kvreuse never imports vLLM: it writes the prompts (token ids, the very ones kvreuse timed) to a job file and runs
`vllm_runner.py` with that venv's python, once with prefix caching off (full prefill) and once with it on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvreuse.bench.workload import Workload
from kvreuse.model.loader import cache_root

RUNNER = Path(__file__).with_name("vllm_runner.py")
SETUP_SCRIPT = "benchmarks/peers/setup_vllm.sh"
MODES = {"vllm:full": "full", "vllm:prefix": "prefix"}


def default_venv() -> Path:
    return Path(os.environ.get("KVREUSE_VLLM_VENV", cache_root() / "venv-vllm"))


@dataclass(frozen=True)
class VllmSettings:
    venv: Path
    model_dir: Path  # a Hugging Face safetensors directory: vLLM cannot read the embedded GGUF
    max_model_len: int
    threads: int  # cores vLLM's OpenMP threads are bound to: as many as kvreuse's torch uses
    kv_cache_bytes: int = 2 * 2**30
    # start-up (model compile) included; a starved or hung engine must not hang the bench
    timeout_seconds: float = 1800.0
    dtype: str = "float32"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def unavailable_reason(settings: VllmSettings) -> str | None:
    """Why the vLLM peer cannot run here, or None when it can."""
    if not settings.python.is_file():
        return f"no vLLM venv at {settings.venv} (create it with {SETUP_SCRIPT})"
    probe = subprocess.run([str(settings.python), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        return f"vLLM does not import in {settings.venv}: {last} (re-run {SETUP_SCRIPT})"
    return None


@dataclass
class VllmTimings:
    seconds: dict[str, list[float]]  # workload id -> TTFT samples
    cached_tokens: dict[str, list[int]]  # workload id -> prompt tokens vLLM served from its prefix cache
    startup_seconds: float
    version: str


def run_vllm(settings: VllmSettings, mode: str, workloads: dict[str, Workload], repeats: int) -> VllmTimings:
    job = {
        "model": str(settings.model_dir), "mode": mode, "repeats": repeats, "dtype": settings.dtype,
        "max_model_len": settings.max_model_len, "kv_cache_bytes": settings.kv_cache_bytes,
        "workloads": [{"id": key, "prompt": w.prompt_ids, "chunk_requests": w.chunk_requests_ids}
                      for key, w in workloads.items()],
    }
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{settings.threads - 1}", OMP_NUM_THREADS=str(settings.threads))
    with tempfile.TemporaryDirectory(prefix="kvreuse-vllm-") as scratch:
        job_path, result_path = Path(scratch, "job.json"), Path(scratch, "result.json")
        job_path.write_text(json.dumps(job))
        log_path = Path(scratch, "vllm.log")
        command = [str(settings.python), str(RUNNER), str(job_path), str(result_path)]
        with log_path.open("w") as log:
            try:
                done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      timeout=settings.timeout_seconds)
            except subprocess.TimeoutExpired:
                sys.stderr.write(log_path.read_text()[-4000:])
                raise RuntimeError(f"the vLLM runner ({mode}) ran past {settings.timeout_seconds:.0f} s") from None
        if done.returncode != 0:
            sys.stderr.write(log_path.read_text()[-4000:])
            raise RuntimeError(f"the vLLM runner ({mode}) exited with code {done.returncode}; its log's end is above")
        result = json.loads(result_path.read_text())
    return VllmTimings(
        seconds={r["id"]: r["seconds"] for r in result["results"]},
        cached_tokens={r["id"]: r["cached_tokens"] for r in result["results"]},
        startup_seconds=result["startup_seconds"],
        version=result["vllm_version"],
    )
