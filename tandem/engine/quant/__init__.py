"""Weight-only quantization of the decoder's linear layers: int8 with a scale per output channel,
int4 with a scale and zero per group of input channels; torch's packed kernels where they work,
dequantize-then-matmul elsewhere, and GGUF Q4_0 / Q4_1 blocks taken as they are."""

from tandem.engine.quant.int4 import Int4Linear, Int4Weight, quantize_int4
from tandem.engine.quant.int8 import Int8Linear, Int8Weight, quantize_int8
from tandem.engine.quant.model import gguf_direct_weights, quantize_model

__all__ = [
    "Int4Linear",
    "Int4Weight",
    "Int8Linear",
    "Int8Weight",
    "gguf_direct_weights",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
]
