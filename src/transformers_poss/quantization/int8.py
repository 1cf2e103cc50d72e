"""int8 weight quantization for the CPU, batch-invariant so tree speculation stays lossless.

On CPUs a decode step is bound by reading weights, so int8 weights make a target forward much cheaper. The scheme
here ([`Int8Linear`]) keeps speculation lossless: weights are int8 with one scale per output channel, activations
are quantized on the fly with one scale PER TOKEN (row) to integers in [-127, 127], and the product is an exact
integer matrix multiply. A token's output therefore depends only on that token, not on the other tokens of the
forward: verifying a tree of n tokens gives each token the same linear outputs as decoding it alone.

The integer product runs on fbgemm's int8 GEMM (``torch.ops.quantized.linear_dynamic``, one weight read for all
rows, so verifying 16 tokens costs little more than decoding one) when this torch build has it and a self-check at
first use confirms it is exact. fbgemm takes 7-bit activations (``reduce_range``, which keeps AVX2's 16-bit pair
sums from saturating) and quantizes its input with one scale for the whole matrix. So each row of integers is split
as ``2 * high + low`` (high in [-64, 63], low in {0, 1}), the high and low rows go through ONE fbgemm call, and two
constant rows (-64 and 63) fix its input scale to exactly 1 and its zero point to 64: the integers pass through
unchanged, every integer product is exact (weights packed with scale 1), and ``2 * high + low`` is summed in float
afterwards, which rounds exactly as a cast of the int32 product does. The per-channel and per-token scales are then
applied in the same order on either kernel. Elsewhere the same steps run on ``torch._int_mm``, slower on CPUs without int8 dot-product
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
ACTIVATION_LEVELS = 127  # per-token activations are rounded to integers in [-127, 127]


# ---------------------------------------------------------------------------------------------------- kernels
class QuantizedRows:
    """A `[M, K]` input rounded per row to integers in [-127, 127] (``integers``, float; ``scale`` `[M, 1]`), and
    its split ``integers = 2 * high + low`` (high in [-64, 63], low in {0, 1}), both 7-bit, stacked under the two pad
    rows in ``padded`` `[2 + 2M, K]` for fbgemm (see the module docstring)."""

    def __init__(self, rows: torch.Tensor):
        self.scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / ACTIVATION_LEVELS
        self.integers = torch.round(rows / self.scale).clamp(-ACTIVATION_LEVELS, ACTIVATION_LEVELS)

    @functools.cached_property
    def padded(self) -> torch.Tensor:
        """Built only for fbgemm (the ``torch._int_mm`` path reads ``integers``), once for all projections."""
        high = torch.floor(self.integers * 0.5)
        return torch.cat([_pads(self.integers.shape[1]), high, self.integers - 2 * high])


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


def _pack_fbgemm(weight_int8: torch.Tensor):
    """fbgemm's packed form of `[out, in]` int8 weights, with scale 1 (the per-channel scales are applied after)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensor API as deprecated
        qweight = torch._make_per_tensor_quantized_tensor(weight_int8.contiguous(), 1.0, 0)
        return torch.ops.quantized.linear_prepack(qweight, None)


def _fbgemm_product(rows: QuantizedRows, packed) -> torch.Tensor:
    """The integer product `integers @ W_int^T` `[M, out]` as float on fbgemm: ``2 * high + low``, each part exact
    (|high products| < 2^24 while in_features < 2064), summed in one rounding like a cast of the int32 result."""
    products = torch.ops.quantized.linear_dynamic(rows.padded, packed, True)
    high, low = products[2:].chunk(2)
    return 2 * high + low


def _int_mm_product(rows: QuantizedRows, weight_int8_t: torch.Tensor) -> torch.Tensor:
    """The integer product on ``torch._int_mm`` (int8 x int8 -> int32), cast to float."""
    return torch._int_mm(rows.integers.to(torch.int8), weight_int8_t).float()


@functools.lru_cache(maxsize=None)
def _pads(in_features: int) -> torch.Tensor:
    pads = torch.zeros(2, in_features)
    pads[0, 0], pads[1, 0] = -64.0, 63.0
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
            rows = QuantizedRows(torch.randn(17, in_features, generator=generator) * 3)
            packed = _pack_fbgemm(weight)
            many = _fbgemm_product(rows, packed)
            reference = _int_mm_product(rows, weight.t().contiguous())
            exact = rows.integers.double() @ weight.double().t()
            one = torch.stack([
                2 * products[0] + products[1]
                for i in range(17)
                for products in [torch.ops.quantized.linear_dynamic(rows.padded[[0, 1, 2 + i, 19 + i]], packed, True)[2:]]
            ])
            if not (torch.equal(many, one) and torch.equal(many, reference)):
                return False
            if not torch.equal(many.double(), exact):
                return False
    except (RuntimeError, NotImplementedError) as error:  # a build without the quantized CPU kernels
        logger.info("fbgemm int8 GEMM unavailable (%s); using torch._int_mm", error)
        return False
    return True


# ---------------------------------------------------------------------------------------------------- module


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 ``W`` (per output channel scales) and per-token int8 activations.

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

    def select_rows(self, index: torch.LongTensor) -> Int8Linear:
        """An `Int8Linear` computing only the output channels ``index`` (e.g. a draft vocabulary's rows of an lm_head),
        sharing nothing with this one and not quantized again."""
        rows = Int8Linear.__new__(Int8Linear)
        nn.Module.__init__(rows)
        index = index.to(self.weight_scale.device)
        rows.out_features, rows.in_features = int(index.numel()), self.in_features
        rows.register_buffer("weight_int8_t", self.weight_int8_t[:, index].contiguous())
        rows.register_buffer("weight_scale", self.weight_scale[index].clone())
        rows.register_buffer("bias", None if self.bias is None else self.bias[index].clone())
        return rows

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
            out = _int_mm_product(rows, self.weight_int8_t)
        out = out * rows.scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(dtype).reshape(*shape[:-1], self.out_features)

    def _packed(self):
        """fbgemm's packed weight, built at first use (not saved; rebuilt when the weight buffer is replaced)."""
        state = self.__dict__.get("_fbgemm")
        if state is None or state[0] is not self.weight_int8_t:
            state = (self.weight_int8_t, _pack_fbgemm(self.weight_int8_t.t()))
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
    model._poss_quantized = "int8/fbgemm" if fbgemm_available() else "int8/int_mm"  # the kernel keys cost profiles
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
