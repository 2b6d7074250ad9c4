"""Fixtures of the parity tests: the bfloat16 reference of the quantization quality tests,
scored once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from quality_measures import score


@pytest.fixture(scope="session")
def bf16_quality(
    smollm2_path: Path, prompt_logits: Callable[..., torch.Tensor]
) -> tuple[float, list[list[int]]]:
    """(perplexity, greedy tokens) of the bfloat16 engine with a bfloat16 KV cache."""
    return score(smollm2_path, prompt_logits)
