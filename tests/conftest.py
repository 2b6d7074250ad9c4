"""Shared fixtures."""

from pathlib import Path

import pytest

from tandem import hub


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct GGUF, pulled once into the default store and reused."""
    return hub.pull("smollm2-135m")
