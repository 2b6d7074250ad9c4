"""Rank 0's whole copy of a vocabulary-parallel model's LM head (and embedding), for the drafters
that run on rank 0 alone.

Medusa and EAGLE heads read the target's final hidden states, which the last all-reduce leaves
whole on every rank, so they run unsharded on rank 0, between the steps the other ranks mirror.
But their logits go through the target's LM head, and EAGLE embeds tokens with the target's
embedding: both are split by vocabulary rows (layers.py), and their forward is a collective the
other ranks would have to mirror. Instead every rank sends its rows to rank 0 once, at load
(`gather_whole_vocab`), and rank 0's drafters use the whole tables: the other ranks' step loop
stays as it is. Memory: rank 0 holds vocab x hidden more in the model dtype (the gathered copy
beside its own shard of the same rows; twice that while gathering), twice that for EAGLE on a
model with untied embeddings. Public Medusa heads carry their own LM heads and leave the copy
unused (every rank would have to read the heads' config to skip it: not done).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.models.linear import linear
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.tp.group import TPGroup


class WholeVocab:
    """The whole LM head and, when gathered, the whole embedding; the same calls as the
    single-device model's (`embed_tokens`, `compute_logits`, `lm_head_weight`)."""

    def __init__(self, lm_head_weight: torch.Tensor, embedding: torch.Tensor | None) -> None:
        self.lm_head_weight = lm_head_weight  # [vocab, hidden]
        self.embedding = embedding  # [vocab, hidden], or None when no drafter embeds

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        if self.embedding is None:
            raise RuntimeError("the embedding was not gathered to rank 0 for this drafter")
        return F.embedding(input_ids, self.embedding)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return linear(hidden, self.lm_head_weight).float()


# What a drafter embeds and scores with: the single-device model, or rank 0's whole copy.
TargetVocab = LlamaForCausalLM | WholeVocab


def gather_whole_vocab(model: LlamaForCausalLM, tp: TPGroup, embedding: bool) -> WholeVocab | None:
    """Every rank calls it (a collective per table): rank 0 gets the whole LM head and, with
    `embedding`, the whole embedding (the same tensor when they are tied); the others None."""
    vocab_size = model.cfg.vocab_size
    head = _gather_rows(tp, model.lm_head_weight, vocab_size)
    embed = None
    if embedding:
        tied = model.lm_head is None
        embed = head if tied else _gather_rows(tp, model.embed_tokens.weight, vocab_size)
    return None if head is None else WholeVocab(head, embed)


def _gather_rows(tp: TPGroup, rows: torch.Tensor, num_rows: int) -> torch.Tensor | None:
    """Rank 0: every rank's `rows` ([n, hidden]) stacked, the padding past `num_rows` cut (a
    view: rank 0 holds the padded table, at most size - 1 rows more)."""
    stacked = tp.gather_rows(rows.detach())  # [n * size, hidden] on rank 0
    return stacked[:num_rows] if tp.rank == 0 else None
