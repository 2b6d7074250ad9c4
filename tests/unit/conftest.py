"""Fixtures of the unit tests: the native kernels of every instruction-set level this CPU runs."""

from __future__ import annotations

from types import ModuleType

import pytest

from tandem.engine import cpu_attention, native
from tandem.engine.models import linear as linear_module


@pytest.fixture(params=native.runnable_levels())  # none where the build failed:
# test_native_levels.py fails then
def kernels(request: pytest.FixtureRequest) -> ModuleType:
    """The native kernels of one level (each test runs once per level the CPU runs)."""
    module = native.extension(request.param)
    assert module is not None
    return module


@pytest.fixture
def at_each_level(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """`kernels`, and the engine's callers of the native kernels (layer ops, RoPE, CPU
    attention) made to call that level's instead of the level in use."""
    real = native.extension
    monkeypatch.setattr(native, "extension", lambda level=None: real(level or kernels.level))
    monkeypatch.setattr(cpu_attention, "kernel", lambda: kernels)
    return kernels


@pytest.fixture
def engine_level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Engines built in the test compute at the level `request.param` names ("in use": the
    process's own), as a process capped by TANDEM_NATIVE_ISA would; skipped where the CPU does
    not run it or where it is the level in use anyway."""
    level: str = request.param
    if level == "in use":
        return native.level_in_use()
    if level not in native.runnable_levels():
        pytest.skip(f"this CPU does not run {level}")
    if level == native.level_in_use():
        pytest.skip(f"{level} is the level in use: the 'in use' case runs it")
    caches = (linear_module._row_gemm, cpu_attention.kernel)
    for cache in caches:
        cache.cache_clear()
    monkeypatch.setattr(native, "level_in_use", lambda: level)
    request.addfinalizer(lambda: [cache.cache_clear() for cache in caches])
    return level
