"""The embedding of a tensor-parallel model: each rank holds a slice of the vocabulary."""

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
