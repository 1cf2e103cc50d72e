"""int8 weight quantization for the CPU.

On CPUs a decode step is bound by reading weights; int8 weights with dynamically quantized activations (fbgemm /
x86 kernels) roughly halve a target forward. torch's dynamic quantization serves the CPU directly (torchao's int8
configs target GPUs first), so it is used here.

Caveat that matters for speculation: dynamic quantization scales the activations of ALL tokens of one forward with
one scale, so a token's logits depend on the other tokens verified beside it. Verifying a tree (or a chain) of
tokens in one forward therefore cannot reproduce the int8 model's own one-token-at-a-time greedy output, and
``generate(assistant_model=draft)`` refuses a target quantized this way (see `is_batch_variant`). Quantizing the
DRAFT is always fine: the draft only proposes, the target decides.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

QUANTIZE_CHOICES = ("none", "int8")


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The float `[out, in]` weight of an ``nn.Linear`` or a dynamically quantized linear."""
    weight = module.weight
    if callable(weight):  # torch.ao dynamic quantized Linear: weight() returns a quantized tensor
        weight = weight()
    if weight.is_quantized:
        weight = weight.dequantize()
    return weight


def linear_bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias() if callable(bias) else bias


def is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "_poss_quantized", None))


def is_batch_variant(model: nn.Module) -> bool:
    """True when ``model`` holds dynamically quantized linears (per-tensor activation scales shared by all tokens of a
    forward), whose output for one token depends on the other tokens computed with it."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return any(isinstance(m, DynamicQuantizedLinear) for m in model.modules())


def quantize_int8(model: nn.Module, include_lm_head: bool = True) -> nn.Module:
    """Quantize every ``nn.Linear`` of ``model`` to int8 weights in place (CPU only); returns ``model``.

    Args:
        include_lm_head: also quantize the output head (the biggest matrix of small models).
    """
    if getattr(model, "_poss_quantized", None):
        return model
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"int8 dynamic quantization runs on the CPU only; the model is on {device}. Use bf16 on GPUs.")
    if model.dtype != torch.float32:
        model.float()
    skip = set()
    if not include_lm_head and hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        skip = {name for name, mod in model.named_modules() if mod is model.get_output_embeddings()}
    targets = {name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and name not in skip}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notice
        from torch.ao.quantization import quantize_dynamic

        quantize_dynamic(model, targets, dtype=torch.qint8, inplace=True)
    model._poss_quantized = "int8"
    return model


def apply_quantization(model: nn.Module, mode: str | None) -> nn.Module:
    """``mode`` in ``QUANTIZE_CHOICES``; 'none' / None returns the model unchanged."""
    if mode in (None, "none"):
        return model
    if mode == "int8":
        return quantize_int8(model)
    raise ValueError(f"unknown quantization {mode!r}; choose one of {QUANTIZE_CHOICES}.")
