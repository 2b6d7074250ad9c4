"""The LM head of a quantized model: int8 logits, the highest of them rescored from the float
weight.

An int8 copy of the output projection (one scale per vocabulary row, `Int8Linear`) computes every
logit of a few-row step reading 1 byte per weight instead of 2 (bfloat16) or 4. Its error, ~1% of
a logit on SmolLM2 (whose Q8_0 table has a scale per 32 weights, which one scale per row
coarsens), would flip greedy near-ties, so the `RESCORED` highest int8 logits of each row are
recomputed from the float weight in float32 (reading those rows of it only) and written over:
the argmax, and the likely tokens of sampling, see the float head's logits; the tail keeps the
int8 ones. Each row is computed on its own (the kernel's rows, a per-row product and sum), so a
row's logits do not depend on the other rows of the step.

The copy costs 1 byte per weight beside the float weight, which stays: it is the embedding table
when the two are tied (SmolLM2: +28 MB beside the 57 MB bfloat16 table), and steps of more than
`max_rows` rows use it, as the float matmul is faster there than the kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.quant.int8 import Int8Linear, kernel_works, quantize_int8

# Rows up to which the int8 kernel beats the float head in bfloat16 (SmolLM2's 576 -> 49152): the
# kernel takes rows four at a time, 1.8 ms for 1-4 rows, 3.6-3.8 ms for 5-8, 5.5 ms for 9-12,
# against 3.6-4.4 ms and 4.6 ms (1 thread, medians of 5).
KERNEL_MAX_ROWS = 8
# The same for the native tiled kernel (`tiles.py`), rescoring included: 1.0 ms for one row, 2.4
# for 8, 4.3 for 16, 7.4 for 32, 14.2 for 64, against the float head's 3.6, 4.8, 6.0, 8.0, 12.6
# (2 threads, 4 December): a clear gain up to 16 rows, within the noise at 32.
TILED_MAX_ROWS = 16
RESCORED = 16  # highest int8 logits per row recomputed from the float weight


class QuantizedLMHead(nn.Module):
    """logits = hidden @ weight.T through an int8 copy of `weight` ([vocab, hidden])."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        int8 = Int8Linear(quantize_int8(weight), None, weight.dtype, weight.device)
        self.max_rows = KERNEL_MAX_ROWS if int8.tiles is None else TILED_MAX_ROWS
        int8.max_kernel_tokens = self.max_rows
        self.int8 = int8

    def rescored_bytes(self, rows: int) -> int:
        """Bytes of the float weight the rescoring of `rows` rows reads."""
        weight = self.int8
        return rows * RESCORED * weight.in_features * weight.model_dtype.itemsize

    def forward(
        self,
        hidden: torch.Tensor,  # [rows, hidden], rows <= max_rows
        weight: torch.Tensor,  # [vocab, hidden] the float weight it was quantized from
    ) -> torch.Tensor:  # [rows, vocab] float32
        logits, top, exact = self.candidates(hidden, weight)
        return logits.scatter_(-1, top, exact)

    def candidates(
        self, hidden: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int8 logits [rows, vocab], the indices of the highest `RESCORED` of them and
        their exact values [rows, RESCORED] (a tensor-parallel head merges those of its ranks,
        tandem/engine/tp/layers.py)."""
        logits = self.int8(hidden).float()
        top = logits.topk(RESCORED, dim=-1).indices  # [rows, RESCORED]
        exact = (weight[top].float() * hidden.float()[:, None, :]).sum(dim=-1)  # [rows, RESCORED]
        return logits, top, exact


def quantize_lm_head(weight: torch.Tensor) -> QuantizedLMHead | None:
    """The int8 head of `weight` ([vocab, hidden]), or None where the int8 kernel does not work
    (dequantizing the head every step would cost more than it saves)."""
    if not kernel_works(weight.device):
        return None
    return QuantizedLMHead(weight.detach())
