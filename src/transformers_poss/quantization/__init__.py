"""Quantized targets that stay lossless under tree verification.

- `int8`: `Int8Linear` (per-channel int8 weights, per-token int8 activations, an exact integer GEMM on fbgemm or ``torch._int_mm``), `quantize_int8`;
- `exact_attention`: ``attn_implementation="poss_exact"``, attention whose result for a query does not depend on the
  other queries of the forward (needed once activations are rounded to int8).
"""

from .exact_attention import EXACT_ATTENTION, register_exact_attention, use_exact_attention
from .int8 import Int8Linear, apply_quantization, has_int8_activations, is_batch_variant, quantize_int8

__all__ = ["EXACT_ATTENTION", "Int8Linear", "apply_quantization", "has_int8_activations", "is_batch_variant",
           "quantize_int8", "register_exact_attention", "use_exact_attention"]
