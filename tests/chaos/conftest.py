"""Fixtures of the chaos suite: a local --no-ray cluster on the tiny random Llama (real worker
processes on loopback, the embedded Redis, the router in this process) and the offline engine's
greedy outputs, which every completed request must equal.

`make test` runs one scenario of each fault class; the scenarios marked `chaos` (deselected by
default) run with the rest under `make chaos`. The helpers of the cluster tests are reused.
Test modules import helpers from `chaos_load`, never from this conftest (another directory's
conftest may be the one Python knows as `conftest`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cluster"))

from chaos_load import MAX_TOKENS, PROMPTS, prompt_ids

from tandem.engine import LLM
from tandem.sampling_params import SamplingParams


@pytest.fixture(scope="session")
def offline_tokens(tiny_llama_path: Path) -> dict[int, list[int]]:
    """The offline engine's greedy tokens for each load prompt."""
    llm = LLM(str(tiny_llama_path), dtype="float32", memory_gib=0.05)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([prompt_ids(i) for i in range(PROMPTS)], params)
    return {i: list(out.token_ids) for i, out in enumerate(outputs)}
