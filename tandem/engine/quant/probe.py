"""Whether one of torch's packed weight-only kernels can be used on a device, and the activation
dtype they get.

The packed kernels are private aten ops whose devices, dtypes and weight layouts change between
torch versions. Rather than trusting a version table, each format runs its kernel once on a small
random layer and compares it with dequantize-then-matmul; a kernel that raises or disagrees is not
used, and the layers fall back to dequantize-then-matmul.

The kernels get bfloat16 activations (and scales) whatever the model dtype: torch vectorizes the
CPU ones for bfloat16 only (on this machine, float32 activations made the int8 kernel 6x and the
int4 one 20x slower than bfloat16 ones, slower than a dense float32 matmul) and the CUDA int4 one
takes nothing else. A float32 model's quantized layers cast to bfloat16 and back around the
kernel; its output keeps bfloat16's precision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

KERNEL_DTYPE = torch.bfloat16

# A layout or formula mismatch gives a relative error of order 1; bf16 rounding stays below 1%.
_MAX_RELATIVE_ERROR = 0.05


def kernel_agrees(
    name: str, kernel: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor]
) -> bool:
    """Run `kernel()` and `reference()` (same output) and say whether the kernel can be used."""
    try:
        got = kernel().float()
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.info("%s unavailable (%s); dequantize-then-matmul instead", name, reason)
        return False
    want = reference().float()
    error = float((got - want).norm() / want.norm())
    if error > _MAX_RELATIVE_ERROR:
        log.warning(
            "%s disagrees with dequantize-then-matmul (relative error %.3g): not used", name, error
        )
        return False
    return True
