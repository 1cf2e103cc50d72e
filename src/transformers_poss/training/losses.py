"""Per-row losses and chain counts of the training objective ([`objective`]), on `[M, V]` logits."""

from __future__ import annotations

import torch

__all__ = ["SoftCrossEntropy", "topk_cross_entropy", "chain_counts"]


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
