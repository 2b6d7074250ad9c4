"""The fault injectors' variables (read in tandem/config.py, for tests only): seconds, none when
unset or 0, and a bad value refused naming the variable."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tandem.config import (
    FAULT_KV_TRAILER_DELAY,
    FAULT_PREFILL_STEP_DELAY,
    fault_kv_trailer_delay_s,
    fault_prefill_step_delay_s,
)


@pytest.mark.parametrize(
    ("name", "read"),
    [
        (FAULT_PREFILL_STEP_DELAY, fault_prefill_step_delay_s),
        (FAULT_KV_TRAILER_DELAY, fault_kv_trailer_delay_s),
    ],
)
def test_a_fault_variable_is_seconds(
    monkeypatch: pytest.MonkeyPatch, name: str, read: Callable[[], float]
) -> None:
    monkeypatch.delenv(name, raising=False)
    assert read() == 0.0
    monkeypatch.setenv(name, "1.5")
    assert read() == 1.5
    for bad, why in (("soon", "seconds"), ("-1", ">= 0")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name} must be {why}"):
            read()
