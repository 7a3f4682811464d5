# Two entry points for a fresh machine: `make run` (the tiny CPU job) and `make test`.
# Both create .venv once (idempotent: re-running reinstalls only when setup.py changes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= examples/tiny_cpu.yaml

.PHONY: install install-sglang run lint test test-slow coverage test-portable test-sglang test-slurm \
	test-all clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU boxes: pin the local CPU build of torch first, so no CUDA torch is pulled in.
	# GPU clusters (nvidia-smi present) keep their CUDA torch.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m megatron_rl_fp8 train $(CONFIG) $(ARGS)

# ruff (pinned in the [dev] extra, configured in pyproject.toml): the same checks as
# .pre-commit-config.yaml; CI runs this before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# pytest-xdist runs the suite on TEST_WORKERS processes (each test module on one worker, so a
# module's shared runs are made once); tests/conftest.py gives each worker its share of the cores
# as threads. `make test` must stay under 10 minutes on 2 cores (.ci/run fails it past 12);
# longer tests are marked `slow` and run by `make test-slow` (CI's next step) and `make test-all`.
TEST_WORKERS ?= 2
PYTEST_PAR := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST_PAR) --durations=15

test-slow: $(STAMP)
	$(PYTEST_PAR) -m slow --durations=15

# Line coverage of megatron_rl_fp8/ over `make test`'s tier and the slow tier together, ranks and
# CLI subprocesses included ([tool.coverage.*] in pyproject.toml): the table, and htmlcov/.
coverage: $(STAMP)
	$(PYTEST_PAR) -m "not sglang and not slurm" --cov --cov-report=term --cov-report=html

# The end-to-end tests again with AVX2 kernels forced in ATen, MKL and oneDNN: on an AVX-512 box
# this computes what an AVX2-only CPU (many AMD and older Intel parts) computes, so a test that
# depends on one CPU's floating-point results fails here rather than on a user's machine.
test-portable: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(PYTEST_PAR) -m "not sglang and not slurm" tests/integration

# SGLang's CPU engine lives in its own venv (.venv-sglang) so its pins never touch .venv.
SGLANG_VENV ?= .venv-sglang

install-sglang:
	scripts/install_sglang_cpu.sh $(SGLANG_VENV)

test-sglang: $(STAMP) install-sglang
	MRF8_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(PY) -m pytest -q -m sglang tests/sglang --durations=10

# A real two-node Slurm on this machine (scripts/slurm_local.sh: root; apt-get installs slurm-wlm
# and munge if absent), started and stopped by the tests; submits slurm/train.sbatch. ~2 min,
# plus the dedicated SGLang rollout node's job (engines + router on n2; needs .venv-sglang).
test-slurm: $(STAMP) install-sglang
	MRF8_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(PY) -m pytest -q -m slurm tests/slurm

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

clean:
	rm -rf runs

# On a GPU node: versions, GPU tests, the tiny job in bf16 and full FP8, GEMM and actor benchmarks
# (docs/gpu.md). Uses .venv if present, else python3; no install (keep the node's CUDA torch).
.PHONY: gpu-check
gpu-check:
	scripts/gpu_check.sh $(ARGS)
