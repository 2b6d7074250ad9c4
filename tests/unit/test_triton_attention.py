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
from typing import Any

import pytest
import torch

from tandem.bench.gpu_kernels import KERNEL_CASES, all_errors, tolerance

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

ROOT = Path(__file__).resolve().parents[2]


def _child(*args: str) -> Any:
    """What this file prints as a child under Triton's interpreter, given `args`."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    """Every case's largest error."""
    return dict(_child("kernels"))


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


def test_engine_on_the_triton_backend_generates_as_on_sdpa(tiny_llama_path: Path) -> None:
    """The whole engine (chunked prefill, prefix hits, ragged decode batches, n-gram drafts
    verified) emits the same greedy tokens on either backend."""
    outputs = _child("engine", str(tiny_llama_path))
    assert outputs["triton"] == outputs["sdpa"]
    assert outputs["triton_drafts"] > 0 and outputs["triton_prefix_hits"] > 0


def _engine_outputs(path: str) -> dict[str, Any]:
    from tandem.engine import LLM, SamplingParams, executor
    from tandem.engine.attention import TritonPagedBackend

    prefix = "the same long prefix of many tokens, then "
    prompts = [prefix + s for s in ("one", "a second prompt", "three three three three")]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs: dict[str, Any] = {}
    for name in ("sdpa", "triton"):
        if name == "triton":  # the factory's choice on CUDA, forced on this CPU
            executor.backend_class = lambda *args: TritonPagedBackend  # type: ignore[assignment]
        llm = LLM(path, block_size=16, max_num_batched_tokens=40,
                  speculative={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
        assert isinstance(llm.engine.runner.backend, TritonPagedBackend) == (name == "triton")
        first = llm.generate(prompts[:1], params)  # cached, so the others start with a hit
        done = first + llm.generate(prompts[1:], params)
        outputs[name] = [o.token_ids for o in done]
        outputs[f"{name}_drafts"] = sum(o.metrics.num_draft_tokens for o in done if o.metrics)
        outputs[f"{name}_prefix_hits"] = llm.engine.kv_cache.stats.prefix_hits
    return outputs


if __name__ == "__main__":  # the child: Triton under its interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1"
    if sys.argv[1] == "kernels":
        print(json.dumps(all_errors(torch.device("cpu"))))
    else:
        print(json.dumps(_engine_outputs(sys.argv[2])))
