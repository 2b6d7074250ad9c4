"""The Triton paged-attention kernels under Triton's interpreter, against a plain reference
(`tandem/bench/gpu_kernels.py`: block sizes 16 and 32, GQA 1/3/4/8, ragged lengths, prefix hits,
chunks, verifications of 1-8 queries, context splits, float32 and bf16, the backend against the
SDPA backend, the padding of a CUDA graph).

`TRITON_INTERPRET=1` must be set before Triton is first imported, and it changes what Triton does
for the whole process; so the kernels run in a child interpreter, one per test module, and this
process never imports Triton. The child prints every case's largest error; the tests assert on
those numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.bench.gpu_kernels import KERNEL_CASES, all_errors, tolerance

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    """Every case's largest error, computed under Triton's interpreter in a child process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_kernel_equals_reference(errors: dict[str, float], name: str) -> None:
    assert errors[name] <= tolerance(name), errors[name]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backend_equals_sdpa_backend_also_padded(errors: dict[str, float], dtype: str) -> None:
    for part in ("backend", "backend_cache", "padded", "padded_cache"):
        name = f"{part}_{dtype}"
        assert errors[name] <= tolerance(name), (name, errors[name])


def test_store_kv_skips_padding_slots(errors: dict[str, float]) -> None:
    assert errors["store_kv"] == 0.0


if __name__ == "__main__":  # the child: Triton under its interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(all_errors(torch.device("cpu"))))
