"""int8 weight quantization for the CPU, batch-invariant so tree speculation stays lossless.

On CPUs a decode step is bound by reading weights, so int8 weights make a target forward much cheaper. The scheme
here ([`Int8Linear`]) keeps speculation lossless: weights are int8 with one scale per output channel, activations
are quantized on the fly with one scale PER TOKEN (row) to 7-bit integers (-63 .. 63), and the product is an exact
integer matrix multiply. A token's output therefore depends only on that token, not on the other tokens of the
forward: verifying a tree of n tokens gives each token the same linear outputs as decoding it alone.

The integer product runs on fbgemm's int8 GEMM (``torch.ops.quantized.linear_dynamic``, one weight read for all
rows, so verifying 16 tokens costs little more than decoding one) when this torch build has it and a self-check at
first use confirms it is exact. fbgemm quantizes its input with one scale for the whole matrix; two constant rows
(-64 and 63) fix that scale to exactly 1 and the zero point to 64, so the already-integer activations pass through
unchanged and its 7-bit activation range (``reduce_range``, which keeps AVX2's 16-bit pair sums from saturating)
holds them exactly. Elsewhere the same product runs on ``torch._int_mm``, slower on CPUs without int8 dot-product
instructions but with the same result.

A float attention kernel still changes its summation order with the number of queries (~1e-7 differences), and
int8 rounding of the next layer's activations can magnify that into a different token; [`quantize_int8`] therefore
also switches the model to ``attn_implementation="poss_exact"`` (float64 attention, see `exact_attention`). With
both, a token's logits are bit-identical whether it is decoded alone or verified in a tree.

torch's own dynamic quantization (``torch.ao.quantization.quantize_dynamic``) is NOT like that: it scales the
activations of all tokens of a forward with one shared scale, so a token's logits depend on the tokens verified
beside it. A target quantized that way is refused by ``generate(assistant_model=draft)`` (see `is_batch_variant`);
quantizing only the DRAFT that way is fine, because the draft only proposes.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings

import torch
from torch import nn

logger = logging.getLogger(__name__)

QUANTIZE_CHOICES = ("none", "int8")
ACTIVATION_LEVELS = 63  # per-token activations are rounded to integers in [-63, 63]


# ---------------------------------------------------------------------------------------------------- kernels
class QuantizedRows:
    """A `[M, K]` input scaled per row so that its largest entry is +-63: ``scaled`` (float; rounding it gives the
    7-bit integers), ``scale`` `[M, 1]`, and ``padded`` = the two pad rows (see the module docstring) then ``scaled``."""

    def __init__(self, rows: torch.Tensor):
        self.scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / ACTIVATION_LEVELS
        self.scaled = rows / self.scale
        self.padded = torch.cat([_pads(rows.shape[1]), self.scaled])

    def integers(self) -> torch.Tensor:
        """The int8 `[M, K]` integers (round half to even, as fbgemm rounds)."""
        return torch.round(self.scaled).clamp(-ACTIVATION_LEVELS, ACTIVATION_LEVELS).to(torch.int8)


_last_input = threading.local()


def quantize_input(hidden: torch.Tensor, in_features: int) -> QuantizedRows:
    """[`QuantizedRows`] of `[..., in]` ``hidden``; the q/k/v (and gate/up) projections read one tensor, so the last
    result is reused while that very tensor, unmodified, comes again (a reference is held, so identity is safe)."""
    cached = getattr(_last_input, "entry", None)
    if cached is not None and cached[0] is hidden and cached[1] == hidden._version:
        return cached[2]
    rows = QuantizedRows(hidden.reshape(-1, in_features).float())
    _last_input.entry = (hidden, hidden._version, rows)
    return rows


def _pack_fbgemm(weight_int8: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed form of `[out, in]` int8 weights with per-output-channel ``scale``."""
    zero_points = torch.zeros(weight_int8.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensor API as deprecated
        qweight = torch._make_per_channel_quantized_tensor(weight_int8.contiguous(), scale.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(qweight, None)


def _fbgemm_product(rows: QuantizedRows, packed) -> torch.Tensor:
    """`(integers @ W_int^T) * weight_scale` `[M, out]` on fbgemm, which rounds ``scaled`` itself (scale 1, zero
    point 64, pinned by the pad rows)."""
    return torch.ops.quantized.linear_dynamic(rows.padded, packed, True)[2:]


def _int_mm_product(rows: QuantizedRows, weight_int8_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product on ``torch._int_mm`` (int8 x int8 -> int32), scaled as fbgemm scales it."""
    return torch._int_mm(rows.integers(), weight_int8_t).float() * scale


@functools.lru_cache(maxsize=None)
def _pads(in_features: int) -> torch.Tensor:
    pads = torch.zeros(2, in_features)
    pads[0, 0], pads[1, 0] = -(ACTIVATION_LEVELS + 1), ACTIVATION_LEVELS
    return pads


@functools.lru_cache(maxsize=1)
def fbgemm_available() -> bool:
    """Whether fbgemm's int8 GEMM is present and, on random data, gives exactly the ``torch._int_mm`` result (and
    the exact integer product) for one row and for many; checked once per process, else ``torch._int_mm`` is used."""
    if not hasattr(torch.ops.quantized, "linear_dynamic") or "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    generator = torch.Generator().manual_seed(0)
    try:
        for in_features, out_features in ((96, 40), (1100, 24)):
            weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
            scale = torch.rand(out_features, generator=generator) / 127 + 1e-3
            rows = QuantizedRows(torch.randn(17, in_features, generator=generator) * 3)
            rows.scaled[:, 1] = torch.arange(17) - 8.5  # exact halves: fbgemm must round them as torch.round does
            rows.padded = torch.cat([_pads(in_features), rows.scaled])
            packed = _pack_fbgemm(weight, scale)
            many = _fbgemm_product(rows, packed)
            reference = _int_mm_product(rows, weight.t().contiguous(), scale)
            exact = (rows.integers().double() @ weight.double().t()) * scale.double()
            one = torch.cat([
                torch.ops.quantized.linear_dynamic(rows.padded[[0, 1, 2 + i]], packed, True)[2:] for i in range(17)
            ])
            if not (torch.equal(many, one) and torch.equal(many, reference)):
                return False
            if ((many.double() - exact).abs() > exact.abs() * 1e-6 + 1e-6).any():
                return False
    except (RuntimeError, NotImplementedError) as error:  # a build without the quantized CPU kernels
        logger.info("fbgemm int8 GEMM unavailable (%s); using torch._int_mm", error)
        return False
    return True


# ---------------------------------------------------------------------------------------------------- module


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 ``W`` (per output channel scales) and per-token 7-bit integer activations.

    Args:
        weight (`torch.Tensor` of shape `[out, in]`): the float weight to quantize.
        bias (`torch.Tensor` of shape `[out]`, *optional*): kept in float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        weight = weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.out_features, self.in_features = weight.shape
        # stored transposed ([in, out]) so the int8 matmul reads it as a plain row-major right operand
        self.register_buffer("weight_int8_t", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).t())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The float `[out, in]` weight this module computes with."""
        return self.weight_int8_t.t().float() * self.weight_scale[:, None]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., in]` -> `[..., out]` in the input's dtype; rows never influence each other."""
        shape, dtype = hidden.shape, hidden.dtype
        rows = quantize_input(hidden, self.in_features)
        if self.weight_int8_t.device.type == "cpu" and fbgemm_available():
            out = _fbgemm_product(rows, self._packed())
        else:
            out = _int_mm_product(rows, self.weight_int8_t, self.weight_scale)
        out = out * rows.scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(dtype).reshape(*shape[:-1], self.out_features)

    def _packed(self):
        """fbgemm's packed weight, built at first use (not saved; rebuilt when the weight buffer is replaced)."""
        state = self.__dict__.get("_fbgemm")
        if state is None or state[0] is not self.weight_int8_t:
            state = (self.weight_int8_t, _pack_fbgemm(self.weight_int8_t.t(), self.weight_scale))
            self.__dict__["_fbgemm"] = state
        return state[1]

    def __getstate__(self):  # copies and pickles rebuild the packed weight instead of carrying it
        state = self.__dict__.copy()
        state.pop("_fbgemm", None)
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The float `[out, in]` weight of an ``nn.Linear``, an [`Int8Linear`] or a torch.ao dynamic quantized linear."""
    if isinstance(module, Int8Linear):
        return module.dequantized_weight()
    weight = module.weight
    if callable(weight):  # torch.ao dynamic quantized Linear: weight() returns a quantized tensor
        weight = weight()
    if weight.is_quantized:
        weight = weight.dequantize()
    return weight


def linear_device(module: nn.Module) -> torch.device:
    """The device of a linear's weight, without unpacking it (an [`Int8Linear`] is not dequantized)."""
    if isinstance(module, Int8Linear):
        return module.weight_int8_t.device
    return linear_weight(module).device


def linear_bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias() if callable(bias) else bias


def is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "_poss_quantized", None))


def is_batch_variant(model: nn.Module) -> bool:
    """True when ``model`` holds torch.ao dynamically quantized int8 linears (one activation scale shared by all
    tokens of a forward), whose output for one token depends on the other tokens computed with it. torch.ao's
    float16-weight linears keep float activations and are not affected."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return any(
        isinstance(m, DynamicQuantizedLinear) and getattr(m._packed_params, "dtype", torch.qint8) == torch.qint8
        for m in model.modules()
    )


def has_int8_activations(model: nn.Module) -> bool:
    """True when ``model`` holds [`Int8Linear`] layers (activations rounded to int8 per token)."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def quantize_int8(model: nn.Module, include_lm_head: bool = True, exact_attention: bool | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by an [`Int8Linear`] in place (CPU only); returns ``model``.

    Embeddings and norms stay in float32. A tied output head gets its own int8 copy (the embedding is unchanged).

    Args:
        include_lm_head: also quantize the output head (the biggest matrix of small models).
        exact_attention: switch the model to ``attn_implementation="poss_exact"`` (see `exact_attention`), which a
            target with int8 activations needs for lossless speculation. Default: yes for transformers models
            other than PosS drafts (a draft only proposes, so it keeps its own attention).
    """
    if getattr(model, "_poss_quantized", None):
        return model
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"int8 quantization here runs on the CPU only; the model is on {device}. Use bf16 on GPUs.")
    if model.dtype != torch.float32:
        model.float()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (include_lm_head or child is not head):
                setattr(parent, name, Int8Linear.from_linear(child))
    model._poss_quantized = "int8"
    config = getattr(model, "config", None)
    if exact_attention is None:
        exact_attention = config is not None and getattr(config, "model_type", None) != "poss_draft"
    if exact_attention:
        from .exact_attention import use_exact_attention

        use_exact_attention(model)
    return model


def apply_quantization(model: nn.Module, mode: str | None) -> nn.Module:
    """``mode`` in ``QUANTIZE_CHOICES``; 'none' / None returns the model unchanged."""
    if mode in (None, "none"):
        return model
    if mode == "int8":
        return quantize_int8(model)
    raise ValueError(f"unknown quantization {mode!r}; choose one of {QUANTIZE_CHOICES}.")
