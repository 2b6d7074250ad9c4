#!/usr/bin/env bash
# The GPU check of issue 32, on one CUDA GPU, from a checkout (no install: it imports only the
# engine core, torch, Triton and transformers).
#
#   scripts/gpu_check.sh --quick     # first: under 90 s
#   scripts/gpu_check.sh             # then: the full check, under 5 minutes
#
# 1. the CUDA tests: the Triton attention kernels and backend against the reference (the cases
#    `make test` runs under Triton's interpreter, here in bf16 on the GPU);
# 2. `tandem bench gpu` (tandem/bench/gpu.py) with the arguments given: its table on stdout, its
#    figures in $OUT/gpu-check.json (or ./gpu-check.json).
# Exits 2 at once, saying why, where torch has no CUDA device or Triton / transformers are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: needs torch with a CUDA device ($PY: torch.cuda.is_available() is False)" >&2
    exit 2
fi
for module in triton transformers; do
    if ! "$PY" -c "import $module" 2>/dev/null; then
        echo "gpu_check: needs the $module package ($PY cannot import it)" >&2
        exit 2
    fi
done
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}")'

echo "== CUDA tests: kernels against the reference"
"$PY" -m tandem.bench.gpu_kernels

echo "== tandem bench gpu $*"
"$PY" -m tandem.bench.gpu --json "${OUT:-.}/gpu-check.json" "$@"
