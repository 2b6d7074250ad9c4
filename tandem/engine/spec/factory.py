"""The engine's proposer for a `SpecConfig`: n-gram lookup, a draft model, a layer-skip
self-draft, Medusa heads, an EAGLE head, or none but a grammar's forced tokens."""

from __future__ import annotations

from typing import Any

from tandem.config import ModelSettings, SpecConfig
from tandem.engine.dtypes import model_device, model_dtype
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.runner import ModelRunner
from tandem.engine.spec.draft import layerskip_proposer, load_draft_proposer
from tandem.engine.spec.draft_vocab import draft_lm_head
from tandem.engine.spec.eagle import EagleProposer, load_eagle
from tandem.engine.spec.medusa import MedusaProposer, load_medusa
from tandem.engine.spec.ngram import NgramProposer
from tandem.engine.spec.proposer import GrammarOnlyProposer, Proposer

# Methods whose proposer hands a prompt's state from the prefill worker that computed it to the
# decode worker (`Proposer.handover_state`): prefill workers run them too.
HANDOVER_METHODS = ("eagle",)
# Methods whose proposer scores drafts with the target's LM head, and with True also embeds
# tokens with the target's embedding: under tensor parallelism rank 0 gathers them whole once
# every rank has loaded (tandem/engine/tp/vocab.py), and the proposer runs on rank 0 alone.
TARGET_VOCAB_METHODS = {"medusa": False, "eagle": True}


def prefill_speculative(decode_speculative: dict[str, Any] | None) -> dict[str, Any] | None:
    """A prefill worker's `speculative` options when its decode workers use
    `decode_speculative`: the same for a method in HANDOVER_METHODS, else none (a prefill
    worker drafts nothing)."""
    if decode_speculative and decode_speculative.get("method") in HANDOVER_METHODS:
        return decode_speculative
    return None


def make_proposer(
    spec: SpecConfig, runner: Any, kv_cache: KVCacheManager, settings: ModelSettings
) -> Proposer:
    """`runner` is the engine's runner; model-based proposers need a real `ModelRunner`."""
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
    if spec.method == "grammar":
        return GrammarOnlyProposer()
    if not isinstance(runner, ModelRunner):
        raise ValueError(f"speculative method {spec.method!r} needs a real engine, not a sim one")
    if spec.method == "draft":
        return load_draft_proposer(spec, runner, kv_cache, settings)
    if spec.method == "layerskip":
        assert spec.num_layers is not None  # SpecConfig requires it for method "layerskip"
        return layerskip_proposer(spec.num_layers, runner, kv_cache)
    if spec.method in ("medusa", "eagle"):
        return _heads_proposer(spec, runner, kv_cache, settings)
    raise ValueError(f"speculative method {spec.method!r} is not built yet")


def _heads_proposer(
    spec: SpecConfig, runner: ModelRunner, kv_cache: KVCacheManager, settings: ModelSettings
) -> Proposer:
    """Medusa heads or an EAGLE head: both read the target's hidden states."""
    assert spec.path is not None  # SpecConfig requires it for these methods
    model, dtype, device = runner.model, model_dtype(settings), model_device(settings)
    vocab = runner.target_vocab()  # under tensor parallelism rank 0's whole copy
    runner.keep_hidden = True
    lm_head = draft_lm_head(spec.path, spec.draft_vocab_size, vocab)
    if spec.method == "medusa":
        heads = load_medusa(spec.path, model, dtype, device)
        return MedusaProposer(heads, lm_head, runner.eos_token_ids)
    head = load_eagle(spec.path, model, kv_cache.block_size, dtype, device)
    return EagleProposer(
        head,
        vocab.embed_tokens,
        lm_head,
        kv_cache.num_blocks,
        kv_cache.block_size,
        device,
        runner.eos_token_ids,
    )
