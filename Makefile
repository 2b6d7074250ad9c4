# Every target creates .venv if needed and installs what it needs first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch unless a CUDA driver is present (then pip picks a CUDA build).
# pytest processes (pytest-xdist, a test file each at a time): the suite's processes keep ~1 of
# 2 cores busy on average (subprocess clusters, waits), so two of them finish it in ~0.6 of the
# time; `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.4" || echo "torch==2.13.0")

.PHONY: install serve test chaos lint bench proto clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -c 'from tandem.engine import native; lib = native.library(); print("native CPU extension:", f"built for {list(lib.levels)}; this CPU runs {lib.cpu_level}" if lib else "unavailable, portable paths")'
	touch $(STAMP)

serve: install
	$(VENV)/bin/tandem models pull smollm2-135m
	$(VENV)/bin/tandem serve

test: install lint
	$(VENV)/bin/tandem models pull smollm2-135m
	$(PY) -m pytest -q -rs --durations=10 -n $(TEST_WORKERS) --dist loadfile

chaos: install  # the full chaos matrix; `make test` runs one scenario of each fault class
	$(PY) -m pytest -q -rs --durations=0 -m "chaos or not chaos" tests/chaos

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy tandem kv_transfer router prefill_worker decode_worker
	$(VENV)/bin/lint-imports --no-cache  # the layers of docs/architecture.md (pyproject.toml)

bench: install
	$(VENV)/bin/tandem models pull smollm2-135m
	$(VENV)/bin/tandem bench engine --json bench-results/engine.json
	$(VENV)/bin/tandem bench transfer --json bench-results/transfer.json

proto: install
	$(PY) -m tandem.protogen

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
