"""int8 weight quantization for the CPU, batch-invariant so tree speculation stays lossless.

On CPUs a decode step is bound by reading weights, so int8 weights make a target forward much cheaper. The scheme
here ([`Int8Linear`]) keeps speculation lossless: weights are int8 with one scale per output channel, activations
are quantized on the fly with one scale PER TOKEN (row) to integers in [-127, 127], and the product is an exact
integer matrix multiply. A token's output therefore depends only on that token, not on the other tokens of the
forward: verifying a tree of n tokens gives each token the same linear outputs as decoding it alone.

The integer product runs on the fastest exact kernel for each matrix shape and number of rows (``torch._int_mm``,
oneDNN's packed GEMM, fbgemm's 8-bit or 7-bit GEMM: see `int8_kernels`), timed on this machine once per process and
shape when a model is quantized; every kernel gives the same int32 product, so the choice never changes a bit.
Sibling projections that read the same input (q/k/v, gate/up) share one quantization and one product
([`FusedProjections`]), with outputs bit-identical to computing them one by one. The per-channel and per-token scales are applied in the same order on every kernel.

A model quantized here is refused by ``save_pretrained`` (its int8 weights would not load back): save the float
model, load it, and quantize again.

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

import logging
import types
import warnings

import torch
from torch import nn

from .int8_kernels import (
    ACTIVATION_LEVELS,
    ROW_BUCKETS,
    KernelState,
    QuantizedRows,
    available_kernels,
    choose_kernel,
    fbgemm_available,
    quantize_input,
    version_of,
)

logger = logging.getLogger(__name__)

QUANTIZE_CHOICES = ("none", "int8")
KERNEL_VERSION = 5  # part of the cost-profile key: bump when the int8 forward's cost changes
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))

__all__ = ["ACTIVATION_LEVELS", "Int8Linear", "QuantizedRows", "fbgemm_available", "quantize_int8"]


def _scaled(product: torch.Tensor, rows: QuantizedRows, weight_scale: torch.Tensor, bias: torch.Tensor | None):
    """`[M, out]` integer product (int32, or float holding integers) -> float32 ``product * row scale * channel scale
    (+ bias)``, in that order on every kernel, elementwise (so a row's result never depends on the others). A float
    product is a fresh tensor of the kernel's, scaled in place (the same bits, one allocation fewer)."""
    out = product.mul_(rows.scale) if product.dtype == torch.float32 else torch.mul(product, rows.scale)
    out.mul_(weight_scale)
    if bias is not None:
        out.add_(bias)
    return out


def pack_dynamic(weight_int8_t: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed `[in, out]` int8 weight with its per-channel scales and bias, for ``per_token=False``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensor API as deprecated
        qweight = torch._make_per_channel_quantized_tensor(
            weight_int8_t.t().contiguous(), weight_scale.double(), torch.zeros_like(weight_scale, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qweight, bias)


def dynamic_product(hidden: torch.Tensor, in_features: int, packed) -> torch.Tensor:
    """`[..., in]` -> `[M, out]` float32 in ONE fbgemm call that quantizes all rows with one scale (drafts only)."""
    reduce_range = not fbgemm_available("fbgemm8")  # 7-bit activations where 8-bit ones could saturate
    rows = hidden if hidden.dim() == 2 else hidden.reshape(-1, in_features)
    rows = rows if rows.dtype == torch.float32 else rows.float()
    return torch.ops.quantized.linear_dynamic(rows, packed, reduce_range)


# ---------------------------------------------------------------------------------------------------- module
class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 ``W`` (per output channel scales) and per-token int8 activations.

    Args:
        weight (`torch.Tensor` of shape `[out, in]`): the float weight to quantize.
        bias (`torch.Tensor` of shape `[out]`, *optional*): kept in float32.
    """

    per_token = True  # False: one fbgemm call with one activation scale per call (drafts: they only propose)

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
        rows.per_token = self.per_token
        return rows

    def dequantized_weight(self) -> torch.Tensor:
        """The float `[out, in]` weight this module computes with."""
        return self.weight_int8_t.t().float() * self.weight_scale[:, None]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., in]` -> `[..., out]` in the input's dtype; rows never influence each other (unless ``per_token`` is
        False: then one fbgemm call quantizes all rows with one scale, fewer operators for a draft's small steps)."""
        fused = self.__dict__.get("_fused")
        if fused is not None and fused.serves(self):
            out = fused.output(self, hidden)
        elif self.dynamic():
            out = dynamic_product(hidden, self.in_features, self._dynamic_packed())
            if hidden.dim() == 2 and out.dtype == hidden.dtype:
                return out
        else:
            rows = quantize_input(hidden, self.in_features)
            if self.weight_int8_t.device.type == "cpu":
                state = self._kernel_state()
                product = state.product(rows, choose_kernel(state, rows.num_rows))
            else:
                product = torch._int_mm(rows.int8, self.weight_int8_t.contiguous())
            out = _scaled(product, rows, self.weight_scale, self.bias)
        if out.dtype != hidden.dtype:
            out = out.to(hidden.dtype)
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def dynamic(self) -> bool:
        """Whether this linear runs as one fbgemm call with one activation scale per call (``per_token=False``)."""
        return not self.per_token and self.weight_int8_t.device.type == "cpu" and fbgemm_available()

    def _kernel_state(self) -> KernelState:
        """The kernels' view of the weight, built at first use (not saved; rebuilt when the buffer is replaced)."""
        weight = self.weight_int8_t
        state = self.__dict__.get("_kernel")
        if state is None or state.source is not weight or state.version != weight._version:
            state = KernelState(weight.contiguous())
            state.source, state.version = weight, weight._version
            self.__dict__["_kernel"] = state
        return state

    def _dynamic_packed(self):
        """fbgemm's packed weight with the per-channel scales and the bias, for ``per_token=False`` (built once)."""
        weight = self.weight_int8_t
        cached = self.__dict__.get("_dynamic")
        if cached is None or cached[0] is not weight or cached[1] != weight._version:
            cached = (weight, weight._version, pack_dynamic(weight, self.weight_scale, self.bias))
            self.__dict__["_dynamic"] = cached
        return cached[2]

    def __getstate__(self):  # copies and pickles rebuild the kernel state (and run unfused) instead of carrying it
        state = self.__dict__.copy()
        for name in ("_kernel", "_fused", "_dynamic"):
            state.pop(name, None)
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FusedProjections:
    """Sibling [`Int8Linear`]s that read the same input (q/k/v, gate/up): ONE integer product for all of them.

    The members' weight buffers become views into one `[in, sum(out)]` int8 matrix (no second copy). The first
    member called with an input computes every member's output; the others return their slice while the very same
    input tensor comes again unmodified, and compute the whole product again otherwise (correct, only slower).
    Each output is bit-identical to the member's own product: the integer product of a channel does not depend on
    the other channels, and the scales are applied elementwise. Members with ``per_token=False`` (drafts) share one
    fbgemm call the same way: its one activation scale comes from the shared input, as in each member's own call.
    """

    def __init__(self, members: list[Int8Linear]):
        self.members = members
        weight = torch.cat([m.weight_int8_t for m in members], dim=1).contiguous()
        scale = torch.cat([m.weight_scale for m in members])
        with_bias = all(m.bias is not None for m in members)
        bias = torch.cat([m.bias for m in members]) if with_bias else None
        self.spans, start = {}, 0
        for member in members:  # registered buffers stay registered when assigned: they become views of the whole
            stop = start + member.out_features
            member.weight_int8_t, member.weight_scale = weight[:, start:stop], scale[start:stop]
            if with_bias:
                member.bias = bias[start:stop]
            self.spans[id(member)] = (start, stop)
            member.__dict__["_fused"] = self
            start = stop
        self._views_of = {id(m): (m.weight_int8_t, m.weight_scale, m.bias) for m in members}
        self.weight, self.weight_scale, self.bias = weight, scale, bias
        self.state, self.version = KernelState(weight), self._versions()
        self._dynamic = None  # fbgemm's packed whole, built when the members run with ``per_token=False``
        self._last = None

    def _versions(self) -> tuple[int, ...]:
        return tuple(t._version for t in (self.weight, self.weight_scale, self.bias) if t is not None)

    def is_current(self) -> bool:
        """Whether every member is still served by the whole (see `serves`); False once any member's buffers were
        replaced (``.to()``, assigning a new tensor)."""
        return all(self.serves(m) for m in self.members)

    def serves(self, member: Int8Linear) -> bool:
        """Whether ``member``'s buffers are still its views of the whole (its slice of the fused product is its own
        output); False once they were replaced, and the member then runs alone. Checked at every call."""
        weight, scale, bias = self._views_of[id(member)]
        buffers = member._buffers
        return buffers["weight_int8_t"] is weight and buffers["weight_scale"] is scale and buffers.get("bias") is bias

    def output(self, member: Int8Linear, hidden: torch.Tensor) -> torch.Tensor:
        """``member``'s `[M, out]` float output for `[..., in]` ``hidden``."""
        if self.version != self._versions():  # loaded in place (the views share their whole's version counter)
            self.state, self.version, self._last, self._dynamic = KernelState(self.weight), self._versions(), None, None
        version = version_of(hidden)
        last = self._last
        if last is None or last[0] is not hidden or last[1] != version or id(member) in last[3]:
            last = self._last = (hidden, version, self._product(member, hidden), set())
        served = last[3]
        served.add(id(member))
        if len(served) == len(self.members):  # every member has its slice: hold nothing between forwards
            self._last = None
        start, stop = self.spans[id(member)]
        return last[2][:, start:stop]

    def _product(self, member: Int8Linear, hidden: torch.Tensor) -> torch.Tensor:
        """Every member's output for ``hidden``, `[M, sum(out)]`, the way ``member`` computes (per token or not)."""
        in_features = self.weight.shape[0]
        if member.dynamic():
            if self._dynamic is None:
                self._dynamic = pack_dynamic(self.weight, self.weight_scale, self.bias)
            return dynamic_product(hidden, in_features, self._dynamic)
        rows = quantize_input(hidden, in_features)
        product = self.state.product(rows, choose_kernel(self.state, rows.num_rows))
        return _scaled(product, rows, self.weight_scale, self.bias)


def fuse_projections(model: nn.Module) -> int:
    """Group the [`Int8Linear`] siblings of ``model`` named in ``FUSED_GROUPS`` (same input size, all present) into
    [`FusedProjections`]; returns the number of groups."""
    groups = 0
    for parent in model.modules():
        for names in FUSED_GROUPS:
            members = [getattr(parent, name, None) for name in names]
            if all(isinstance(m, Int8Linear) for m in members) and len({m.in_features for m in members}) == 1 \
                    and len({m.bias is None for m in members}) == 1:
                if len({m.weight_int8_t.device for m in members}) == 1 and members[0].weight_int8_t.device.type == "cpu":
                    FusedProjections(members)
                    groups += 1
    return groups


def choose_kernels(model: nn.Module) -> None:
    """Time the kernel choice of every weight shape and row bucket of ``model`` now (once per process): at first
    use it would be timed inside the first forwards that reach each bucket, and a speculation budget measuring those
    rounds would see seconds of kernel timing as the cost of speculating."""
    states = {}
    for module in model.modules():
        if isinstance(module, Int8Linear) and module.per_token and module.weight_int8_t.device.type == "cpu":
            fused = module.__dict__.get("_fused")
            state = fused.state if fused is not None and fused.is_current() else module._kernel_state()
            states.setdefault(tuple(state.weight_int8_t.shape), state)
    for state in states.values():
        state.keep_only({choose_kernel(state, bucket) for bucket in ROW_BUCKETS})  # the timing packed every kernel


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


def quantize_int8(model: nn.Module, include_lm_head: bool = True, exact_attention: bool | None = None,
                  per_token: bool | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by an [`Int8Linear`] in place (CPU only); returns ``model``.

    Embeddings and norms stay in float32. A tied output head gets its own int8 copy (the embedding is unchanged).

    Args:
        include_lm_head: also quantize the output head (the biggest matrix of small models).
        exact_attention: switch the model to ``attn_implementation="poss_exact"`` (see `exact_attention`), which a
            target with int8 activations needs for lossless speculation. Default: yes for transformers models
            other than PosS drafts (a draft only proposes, so it keeps its own attention).
        per_token: per-token activation scales, so a token's outputs never depend on the tokens computed beside it
            (what a target verified in trees needs). Default: yes except for PosS drafts, whose linears then run as
            one fbgemm call each (one activation scale per call), which cuts a draft step's operators several-fold.
    """
    if getattr(model, "_poss_quantized", None):
        return model
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"int8 quantization here runs on the CPU only; the model is on {device}. Use bf16 on GPUs.")
    if model.dtype != torch.float32:
        model.float()
    config = getattr(model, "config", None)
    is_draft = config is not None and getattr(config, "model_type", None) == "poss_draft"
    per_token = (not is_draft or not fbgemm_available()) if per_token is None else per_token
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (include_lm_head or child is not head):
                quantized = Int8Linear.from_linear(child)
                quantized.per_token = per_token
                setattr(parent, name, quantized)
    fuse_projections(model)
    if per_token:
        choose_kernels(model)
    # the kernels available here key cost profiles (the per-shape choice is timed once per process, see above)
    model._poss_quantized = f"int8/v{KERNEL_VERSION}/" + "+".join(available_kernels()) + ("" if per_token else "/dynamic")
    model.save_pretrained = types.MethodType(_refuse_save, model)
    if exact_attention is None:
        exact_attention = config is not None and not is_draft
    if exact_attention:
        from .exact_attention import use_exact_attention

        use_exact_attention(model)
    return model


def _refuse_save(model, *args, **kwargs):
    raise ValueError(
        f"this {type(model).__name__} was quantized in place by quantize_int8: its int8 weights would not load back "
        "with from_pretrained. Save the float model before quantizing, and call quantize_int8 again after loading."
    )


def apply_quantization(model: nn.Module, mode: str | None) -> nn.Module:
    """``mode`` in ``QUANTIZE_CHOICES``; 'none' / None returns the model unchanged."""
    if mode in (None, "none"):
        return model
    if mode == "int8":
        return quantize_int8(model)
    raise ValueError(f"unknown quantization {mode!r}; choose one of {QUANTIZE_CHOICES}.")
