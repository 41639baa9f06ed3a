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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Protocol, TypeVar

from kvreuse.model.identity import cache_root
from kvreuse.model.linear import ONEDNN_CAPACITIES_SET

RUNNER = Path(__file__).with_name("vllm_runner.py")
IMPORT_ROOT = Path(__file__).parents[3]  # the directory holding the kvreuse package
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


class PeerPrompt(Protocol):
    """A prompt as the peer sees it: its token ids, and the requests that brought its chunks in (mode prefix)."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def chunk_requests_ids(self) -> list[list[int]]: ...


@dataclass(frozen=True)
class PlainPrompt:
    """A prompt with no chunks: what a full-prefill benchmark sends."""

    prompt_ids: list[int]
    chunk_requests_ids: list[list[int]] = field(default_factory=list)


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


def run_vllm(settings: VllmSettings, mode: str, workloads: Mapping[str, PeerPrompt], repeats: int) -> VllmTimings:
    """Prefill timings (mode full or prefix) of every workload."""
    result = _run_job(settings, mode, {
        "workloads": [{"id": key, "prompt": w.prompt_ids, "chunk_requests": w.chunk_requests_ids}
                      for key, w in workloads.items()]}, repeats)
    return VllmTimings(
        seconds={r["id"]: r["seconds"] for r in result["results"]},
        cached_tokens={r["id"]: r["cached_tokens"] for r in result["results"]},
        startup_seconds=result["startup_seconds"],
        version=result["vllm_version"],
    )


@dataclass
class VllmDecodeTimings:
    step_seconds: dict[str, list[float]]  # batch id -> seconds of one decoding step of the whole batch
    startup_seconds: float
    version: str


def run_vllm_decode(settings: VllmSettings, batches: Mapping[str, list[list[int]]], steps: int, repeats: int
                    ) -> VllmDecodeTimings:
    """Decoding-step timings of every batch of prompts (vllm_runner.py, mode decode)."""
    result = _run_job(settings, "decode", {
        "batches": [{"id": key, "prompts": prompts} for key, prompts in batches.items()], "steps": steps,
        "workloads": []}, repeats)
    return VllmDecodeTimings({r["id"]: r["step_seconds"] for r in result["results"]}, result["startup_seconds"],
                             result["vllm_version"])


T = TypeVar("T", VllmTimings, VllmDecodeTimings)


def each_dtype(model_dir: Path, max_model_len: int, threads: int, venv: Path, dtypes: list[str], what: str,
               job: Callable[[VllmSettings], T]) -> Iterator[tuple[str, T]]:
    """`job` run once per dtype in the vLLM venv. A missing venv or a failing runner is printed and ends the
    peer's figures, never the caller's."""
    for dtype in dtypes:
        settings = VllmSettings(venv, model_dir, max_model_len, threads=threads, dtype=dtype)
        reason = unavailable_reason(settings)
        if reason:
            print(f"peer vllm skipped: {reason}")
            return
        print(f"peer vllm ({dtype}): {what} in {venv} ...")
        try:
            timings = job(settings)
        except RuntimeError as e:
            print(f"peer vllm failed: {e}")
            return
        print(f"vLLM {timings.version}, {dtype}: started in {timings.startup_seconds:.0f} s")
        yield dtype, timings


@dataclass
class RoundPrompt:
    ids: list[int]
    salt: str | None = None  # vLLM's cache_salt
    kv_transfer_params: dict | None = None  # for the connector (kvreuse_chunks, kvreuse_store_chunk)


@dataclass
class Round:
    """Prompts generated greedily one at a time, after emptying vLLM's prefix cache if asked (and stopping a
    Redis server, for fault tests)."""

    prompts: list[RoundPrompt]
    max_tokens: int
    reset_prefix_cache: bool = False
    stop_redis: str | None = None
    logprobs: bool = False  # return the first token's log-probabilities over the vocabulary

    @classmethod
    def of(cls, prompts: list[list[int]], max_tokens: int, **options) -> Round:
        return cls([RoundPrompt(ids) for ids in prompts], max_tokens, **options)


@dataclass
class Generated:
    tokens: list[int]
    cached_tokens: int  # prompt tokens vLLM did not compute: its prefix cache's and the connector's
    seconds: float
    first_logprobs: list[float]  # over the vocabulary, when the round asked for them


@dataclass
class RoundsResult:
    rounds: list[list[Generated]]
    startup_seconds: float
    log: str  # the engine's log, where the connector reports what it loaded


def run_vllm_rounds(settings: VllmSettings, rounds: list[Round], connector: dict | None = None,
                    enforce_eager: bool = False, step_tokens: int | None = None,
                    hf_overrides: dict | None = None) -> RoundsResult:
    """`rounds` through one vLLM engine with prefix caching on, with `connector` as its kv_transfer_config;
    `step_tokens` caps the tokens of one engine step (chunked prefill), by default a whole prompt;
    `hf_overrides` changes the model's config (vLLM's --hf-overrides)."""
    work = {"rounds": [asdict(r) for r in rounds], "workloads": [], "enforce_eager": enforce_eager,
            "max_num_batched_tokens": step_tokens, "hf_overrides": hf_overrides}
    if connector is not None:
        work["kv_transfer_config"] = connector
    result = _run_job(settings, "rounds", work, repeats=0)
    return RoundsResult([[Generated(o["tokens"], o["cached_tokens"], o["seconds"], o["first_logprobs"]) for o in outputs]
                         for outputs in result["results"]], result["startup_seconds"], result["log"])


def peer_environment() -> dict[str, str]:
    """This process's environment as the user set it: without the oneDNN capacities kvreuse set for itself."""
    return {name: value for name, value in os.environ.items() if name not in ONEDNN_CAPACITIES_SET}


def _run_job(settings: VllmSettings, mode: str, work: dict, repeats: int) -> dict:
    job = {"model": str(settings.model_dir), "mode": mode, "repeats": repeats, "dtype": settings.dtype,
           "max_model_len": settings.max_model_len, "kv_cache_bytes": settings.kv_cache_bytes, **work}
    env = dict(peer_environment(), VLLM_CPU_OMP_THREADS_BIND=f"0-{settings.threads - 1}",
               OMP_NUM_THREADS=str(settings.threads),
               PYTHONUNBUFFERED="1",  # vLLM kills its engine process at shutdown: its log lines must be out by then
               # kvreuse's connector is imported inside vLLM's processes, from this checkout
               PYTHONPATH=os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")])))
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
        return {**json.loads(result_path.read_text()), "log": log_path.read_text()}
