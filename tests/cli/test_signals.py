"""A command stopped by SIGTERM (kill, timeout, a cancelled CI job) cleans up as after Ctrl-C: the private
redis-server it started stops and its temp folders go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def cmdline(pid: int) -> str:
    """A short-lived child (a compiler, lscpu) may be gone between listing and reading: it reads as empty."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_a_bench_stopped_by_sigterm_stops_its_redis_server(tiny_model_dir, tmp_path):
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvreuse.cli", "bench", "ttft", "--model", str(tiny_model_dir), "--tiers", "redis",
         "--lengths", "4096", "--chunks", "4", "--methods", "naive", "--peers", "none", "--repeats", "1000",
         "--out", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 90
        while not (servers := [c for c in children(bench.pid) if "redis-server" in cmdline(c)]):
            assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read() if bench.poll() else ""
            time.sleep(0.2)
        time.sleep(2)  # into the run
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        bench.kill()
    assert not alive(servers[0])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvreuse-")]  # redis's and the disk tier's
