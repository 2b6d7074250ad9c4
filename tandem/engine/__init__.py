"""The inference core: paged KV cache, scheduler, runner, sampler, offline API (torch only).

`LLM`, `RequestOutput` and `SamplingParams` are imported on first use, so that a module of the
engine (`tandem.engine.native`, say) can be imported without the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.engine.llm import LLM, RequestOutput
    from tandem.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "tandem.engine.llm",
    "RequestOutput": "tandem.engine.llm",
    "SamplingParams": "tandem.sampling_params",
}
__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
