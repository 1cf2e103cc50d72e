"""Per-row losses and chain counts of the training objective ([`objective`]), on `[M, V]` logits."""

from __future__ import annotations

import torch

__all__ = ["SoftCrossEntropy", "SoftLabels", "HeadSoftCrossEntropy", "head_chunk_rows", "topk_cross_entropy",
           "chain_counts"]


class SoftCrossEntropy(torch.autograd.Function):
    """Row-wise soft cross-entropy ``-sum_v p_v log softmax(z)_v = logsumexp(z) - <p, z>`` of `[M, V]` logits z
    under fixed target probabilities p, with the fused gradient ``softmax(z) - p``.

    Equal to autograd through ``log_softmax`` but with fewer passes over the `[M, V]` tensors, which dominate the
    cost of training on CPUs.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=logits.device.type, enabled=False):  # keep fp32 under bf16/fp16 training
            dtype = torch.promote_types(logits.dtype, torch.float32)
            logits, probs = logits.to(dtype), probs.to(dtype)
            lse = torch.logsumexp(logits, dim=-1)
            dot = torch.bmm(probs.unsqueeze(1), logits.unsqueeze(2)).view(-1)
        ctx.save_for_backward(logits, probs, lse)
        return lse - dot

    @staticmethod
    def backward(ctx, grad):
        logits, probs, lse = ctx.saved_tensors
        return (logits - lse[:, None]).exp_().sub_(probs).mul_(grad[:, None]), None


CHUNK_BYTES = 2**23  # float32 logits of one chunk of rows: within the L3 cache, rows enough for a fast product


def head_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk of [`HeadSoftCrossEntropy`]: their float32 logits take about ``CHUNK_BYTES``."""
    return max(16, CHUNK_BYTES // (4 * vocab_size))


class SoftLabels:
    """The soft labels ``softmax(features @ weight^T + bias)`` `[M, V]` of a chunked loss, computed chunk by chunk.

    ``rows(start, end)`` gives the float32 probabilities of rows ``start .. end - 1`` (the head's product in
    ``compute_dtype``, the softmax in float32) and records their top-1 tokens in ``top1`` `[M]`. Asked once per row
    (one unrolled step), nothing `[M, V]` is kept; [`store`] keeps all rows for losses that read them several times.
    Either way the `[M, V]` logits never make a round trip through memory, which bounds these passes on CPUs.
    """

    def __init__(self, features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype):
        self.features, self.weight = features.detach().to(compute_dtype), weight.detach().to(compute_dtype)
        self.bias = None if bias is None else bias.detach().float()
        self.top1 = torch.empty(features.shape[0], dtype=torch.long, device=features.device)
        self.probs = None

    def __len__(self) -> int:
        return self.features.shape[0]

    @torch.no_grad()
    def rows(self, start: int, end: int) -> torch.Tensor:
        if self.probs is not None:
            return self.probs[start:end]
        with torch.autocast(device_type=self.features.device.type, enabled=False):
            logits = torch.mm(self.features[start:end], self.weight.t()).float()
            if self.bias is not None:
                logits += self.bias
            self.top1[start:end] = logits.max(-1).indices  # the first maximum, as argmax (and a little faster)
            return torch.softmax(logits, dim=-1)

    def store(self, chunk_rows: int) -> "SoftLabels":
        """Compute every row once, in chunks, and keep them (float32 `[M, V]`)."""
        probs = torch.empty(len(self), self.weight.shape[0], dtype=torch.float32, device=self.features.device)
        for start in range(0, len(self), chunk_rows):
            probs[start : start + chunk_rows] = self.rows(start, min(len(self), start + chunk_rows))
        self.probs = probs
        return self


class HeadSoftCrossEntropy(torch.autograd.Function):
    """[`SoftCrossEntropy`] of the logits ``features @ weight^T + bias``, fused with the head and computed in chunks
    of rows, so the `[M, V]` logits never make a round trip through memory.

    ``apply(features [M, H], weight [V, H], bias [V] | None, labels, compute_dtype, chunk_rows)`` ->
    ``(loss [M], top1 [M])``: per-row ``logsumexp(z) - <p, z>`` and the draft's top-1 token (no gradient). The
    labels p are probabilities `[M, V]` or [`SoftLabels`] (computed chunk by chunk, beside the loss). Each chunk's
    logits are computed in ``compute_dtype`` (bfloat16 under CPU/GPU autocast), the softmax in float32; the forward
    also stores ``softmax(z) - p`` `[M, V]` in ``compute_dtype``, from which the backward gets the gradients of
    ``features`` (and of ``weight`` / ``bias`` when they require it) with two products.
    """

    @staticmethod
    def forward(ctx, features, weight, bias, labels, compute_dtype, chunk_rows):
        rows, vocab = features.shape[0], weight.shape[0]
        with torch.autocast(device_type=features.device.type, enabled=False):
            x, w = features.to(compute_dtype), weight.to(compute_dtype)
            loss = torch.empty(rows, dtype=torch.float32, device=features.device)
            top1 = torch.empty(rows, dtype=torch.long, device=features.device)
            residual = torch.empty(rows, vocab, dtype=compute_dtype, device=features.device)  # softmax - p
            shift = None if bias is None else bias.float()
            for start in range(0, rows, chunk_rows):
                end = min(rows, start + chunk_rows)
                logits = torch.mm(x[start:end], w.t()).float()
                if shift is not None:
                    logits += shift
                p = labels.rows(start, end) if isinstance(labels, SoftLabels) else labels[start:end].float()
                peak, best = logits.max(-1)  # the first maximum, as argmax
                top1[start:end] = best
                q = torch.softmax(logits, dim=-1)  # one fused kernel (separate exp / sum / div passes cost 2x)
                # logsumexp(z) = max - log q[argmax], since q[argmax] = exp(max - max) / sum exp(z - max)
                lse = peak - q.gather(-1, best[:, None]).view(-1).log()
                loss[start:end] = lse - torch.linalg.vecdot(p, logits)
                torch.sub(q, p, out=residual[start:end])
        ctx.save_for_backward(x, w, residual)
        ctx.grad_weight, ctx.grad_bias = weight.requires_grad, bias is not None and bias.requires_grad
        ctx.dtypes = (features.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(top1)
        return loss, top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_top1):
        x, w, residual = ctx.saved_tensors
        features_dtype, weight_dtype, bias_dtype = ctx.dtypes
        with torch.autocast(device_type=x.device.type, enabled=False):
            scale = grad_loss.to(residual.dtype)[:, None]
            grad_features = (torch.mm(residual, w) * scale).to(features_dtype)
            grad_weight = torch.mm(residual.t(), x * scale).to(weight_dtype) if ctx.grad_weight else None
            grad_bias = (residual.float() * scale.float()).sum(0).to(bias_dtype) if ctx.grad_bias else None
        return grad_features, grad_weight, grad_bias, None, None, None


def topk_cross_entropy(target_logp: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row cross-entropy `[M]` restricted to the target's top-k tokens (HASS distillation term)."""
    top_logp, top_idx = target_logp.topk(min(k, target_logp.shape[-1]), dim=-1)
    draft_logp = torch.log_softmax(logits, dim=-1)
    return -(top_logp.exp() * draft_logp.gather(-1, top_idx)).sum(-1)


def chain_counts(correct_maps, masks):
    """Counts for the position-wise acceptance rate along the target's continuation.

    For depth k + 1 and query t the chain is step j at position t - k + j, j = 0..k. Among chains lying entirely
    in their steps' masks, ``numerator[k]`` counts those with steps 0..k all correct and ``denominator[k]`` those
    with steps 0..k-1 all correct: their ratio estimates P(depth k+1 accepted | depths 1..k accepted).
    """
    numerator, denominator = [], []
    length = masks[0].shape[1]
    for k in range(len(masks)):
        before = torch.ones_like(masks[k])
        inside = masks[k].clone()
        for j in range(k + 1):
            shift = k - j  # step j's member of the chain ending at t is at t - shift
            ok = torch.zeros_like(masks[k])
            member = torch.zeros_like(masks[k])
            ok[:, shift:] = correct_maps[j][:, : length - shift]
            member[:, shift:] = masks[j][:, : length - shift]
            inside &= member
            if j < k:
                before &= ok
        denominator.append((before & inside).sum())
        numerator.append((before & inside & correct_maps[k]).sum())
    return numerator, denominator
