"""The vocabulary-parallel ends of a tensor-parallel model: the embedding, and the logits of an
int8 LM head (quant/lm_head.py) gathered as one device's head computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.tp.group import TPGroup


class VocabParallelEmbedding(nn.Embedding):
    """Rows [rank * n, (rank + 1) * n) of the table; a token outside them looks up zeros, and the
    all-reduce sums the one rank's row that holds it with the others' zeros (exact)."""

    def __init__(
        self, num_rows: int, dim: int, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(num_rows, dim, dtype=dtype, device=device)
        self.tp = tp
        self.first = tp.rank * num_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [n, dim]
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


def gather_rescored_logits(
    tp: TPGroup,
    logits: torch.Tensor,  # [rows, n] int8 logits of this rank's vocabulary rows
    top: torch.Tensor,  # [rows, k] indices of its highest k
    exact: torch.Tensor,  # [rows, k] their exact values
    vocab_size: int,
) -> torch.Tensor:  # rank 0: [rows, vocab_size]; the others: `logits`
    """The whole vocabulary's int8 logits with the k highest exact, as on one device: the whole
    vocabulary's k highest are among the ranks' own k highest, which each rank rescored, and only
    they keep their exact value (the others' int8 one), so greedy picks the same token."""
    rows, n = logits.shape
    k = top.shape[1]
    local = torch.cat([logits, exact, (top + tp.rank * n).float()], dim=1)
    gathered = tp.gather_columns(local)
    if tp.rank != 0:
        return logits
    parts = gathered.view(rows, tp.size, n + 2 * k)
    whole = parts[..., :n].reshape(rows, -1)  # [rows, size * n]
    index = parts[..., n + k :].reshape(rows, -1).long()
    exact_values = parts[..., n : n + k].reshape(rows, -1)
    rescored = torch.full_like(whole, torch.nan).scatter_(1, index, exact_values)
    whole, rescored = whole[:, :vocab_size], rescored[:, :vocab_size]
    best = whole.topk(k, dim=-1).indices
    found = rescored.gather(1, best)  # NaN only where a tie put one outside a rank's k highest
    return whole.scatter_(1, best, torch.where(found.isnan(), whole.gather(1, best), found))
