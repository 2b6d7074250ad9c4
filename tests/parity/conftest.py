"""Fixtures of the parity tests: the bfloat16 reference of the quantization quality tests,
scored once per test run (both xdist workers read it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from quality_measures import score


@pytest.fixture(scope="session")
def bf16_quality(
    smollm2_path: Path,
    prompt_logits: Callable[..., torch.Tensor],
    once_per_run: Callable[[str, Callable[[], Any]], Any],
) -> tuple[float, list[list[int]]]:
    """(perplexity, greedy tokens) of the bfloat16 engine with a bfloat16 KV cache."""
    return once_per_run("bf16_quality", lambda: score(smollm2_path, prompt_logits))
