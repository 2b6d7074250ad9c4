"""The engine's proposer for a `SpecConfig`: n-gram lookup, a draft model, a layer-skip
self-draft, Medusa heads or an EAGLE head."""

from __future__ import annotations

from typing import Any

from tandem.config import ModelSettings, SpecConfig
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.runner import ModelRunner
from tandem.engine.spec.ngram import NgramProposer
from tandem.engine.spec.proposer import Proposer


def make_proposer(
    spec: SpecConfig, runner: Any, kv_cache: KVCacheManager, settings: ModelSettings
) -> Proposer:
    """`runner` is the engine's runner; model-based proposers need a real `ModelRunner`."""
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
    if not isinstance(runner, ModelRunner):
        raise ValueError(f"speculative method {spec.method!r} needs a real engine, not a sim one")
    raise ValueError(f"speculative method {spec.method!r} is not built yet")
