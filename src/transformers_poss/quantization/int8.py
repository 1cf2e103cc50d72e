"""int8 weight quantization for the CPU, batch-invariant so tree speculation stays lossless.

On CPUs a decode step is bound by reading weights, so int8 weights make a target forward much cheaper. The scheme
here ([`Int8Linear`]) keeps speculation lossless: weights are int8 with one scale per output channel, activations
are quantized on the fly with one scale PER TOKEN (row), and the product is an exact int8 x int8 -> int32 matrix
multiply (``torch._int_mm``). A token's output therefore depends only on that token, not on the other tokens of the
forward: verifying a tree of n tokens gives each token the same linear outputs as decoding it alone.

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

import torch
from torch import nn

QUANTIZE_CHOICES = ("none", "int8")


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

    def dequantized_weight(self) -> torch.Tensor:
        """The float `[out, in]` weight this module computes with."""
        return self.weight_int8_t.t().float() * self.weight_scale[:, None]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., in]` -> `[..., out]` in the input's dtype; rows never influence each other."""
        shape, dtype = hidden.shape, hidden.dtype
        rows = hidden.reshape(-1, self.in_features).float()
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        quantized = torch.round(rows / row_scale).clamp(-127, 127).to(torch.int8)
        out = torch._int_mm(quantized, self.weight_int8_t).float() * row_scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(dtype).reshape(*shape[:-1], self.out_features)

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
