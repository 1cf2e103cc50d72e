"""The multi-step (HASS-aligned) training objective of PosS drafts.

Conventions (one sequence of tokens x_0 .. x_{T} with target features f_0 .. f_{T}):

- ``input_ids[:, t]`` is x_{t+1} and ``target_hidden_states[:, t]`` is f_t: pair t = (f_t, x_{t+1}).
- The regression target of pair t is f_{t+1} = ``target_hidden_states[:, t + 1]`` (the last pair has none).
- ``loss_mask[:, t]`` selects the pairs whose prediction counts (those whose predicted feature f^_{t+1} yields an
  assistant token x_{t+2}); see [`transformers_poss.training.data.pair_loss_mask`].

Unrolled steps k = 0 .. K-1 (K = ``draft.config.training_depth`` by default):

- step 0 runs over the fused target pairs with causal attention;
- step k >= 1 feeds at position t the pair (out^{k-1}_{t-1} detached, x_{t+1}); its query attends over the target
  pairs at positions <= t-k (the accepted context) and over the step-j rows at exactly position t-k+j, j = 1..k (the
  drafted ancestors, itself included). This is what drafting computes at depth k+1 after accepting up to t-k.
- step k uses specialist ``config.specialist_for_step(k)``; each specialist projects its own keys/values.
- loss of step k = ``feature_weight * SmoothL1(f^, f_next) + ce_weight * CE(p_target, log q_draft)``
  (+ ``topk_weight`` x the same CE restricted to the target's top-k tokens), each summed over the positions of the
  step's mask and divided by their count. Positions t < k have no full context and are never trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["ObjectiveFields", "ObjectiveConfig", "check_objective", "set_objective", "get_objective", "unroll", "training_forward", "step_attention_mask"]


@dataclass
class ObjectiveFields:
    """Settings of the training objective (also fields of [`PosSTrainingArguments`], which inherits them).

    Args:
        num_unrolled_steps (`int`, *optional*): steps unrolled per batch; default ``config.training_depth``.
        feature_weight (`float`): weight of the SmoothL1 feature regression (spec: 1.0).
        ce_weight (`float`): weight of the soft cross-entropy through the target's lm_head (spec: 0.1).
        topk_weight (`float`): weight of the HASS top-k distillation term (0 for PosS).
        topk (`int`): tokens of the target distribution used by the top-k term.
        noise (`str`): ``"uniform"``, ``"gaussian"`` or ``"none"``; added to the target input features in training.
        noise_scale (`float`): width of the uniform noise ((U - 0.5) * scale) or std of the gaussian noise. The
            authors' uniform noise is 0.2 * 512 / seq_len, i.e. 0.05 at their 2048-token sequences.
        step_weights (`list[float]`, *optional*): per-step loss weights (default: 1.0 each, summed).
        attention_chunk_size (`int`): queries per attention call in steps >= 1 (bounds memory; exact either way).
    """

    num_unrolled_steps: int | None = field(default=None, metadata={"help": "Unrolled steps (default: training_depth)."})
    feature_weight: float = field(default=1.0, metadata={"help": "SmoothL1 feature loss weight."})
    ce_weight: float = field(default=0.1, metadata={"help": "Soft cross-entropy weight."})
    topk_weight: float = field(default=0.0, metadata={"help": "HASS top-k distillation weight."})
    topk: int = field(default=10, metadata={"help": "Tokens of the top-k term."})
    noise: str = field(default="uniform", metadata={"help": "Input-feature noise: uniform, gaussian or none."})
    noise_scale: float = field(default=0.05, metadata={"help": "Uniform noise width or gaussian std."})
    step_weights: list[float] | None = field(
        default=None, metadata={"help": "Loss weight of each unrolled step (default: 1.0 each)."}
    )
    attention_chunk_size: int = field(default=256, metadata={"help": "Queries per attention call (memory bound)."})


def check_objective(settings: ObjectiveFields) -> None:
    """Clear errors for objective settings that cannot work."""
    if settings.noise not in ("uniform", "gaussian", "none"):
        raise ValueError(f"noise must be 'uniform', 'gaussian' or 'none', got {settings.noise!r}.")
    if settings.step_weights is not None and any(w < 0 for w in settings.step_weights):
        raise ValueError(f"step_weights must be >= 0, got {settings.step_weights}.")


OBJECTIVE_FIELDS = tuple(f.name for f in fields(ObjectiveFields))


@dataclass
class ObjectiveConfig(ObjectiveFields):
    """The objective's settings on their own (see [`ObjectiveFields`]), e.g. for `set_objective`."""

    def __post_init__(self):
        check_objective(self)

    @classmethod
    def from_dict(cls, values: dict | None) -> "ObjectiveConfig":
        names = set(OBJECTIVE_FIELDS)
        unknown = set(values or {}) - names
        if unknown:
            raise ValueError(f"Unknown objective settings {sorted(unknown)}; known: {sorted(names)}.")
        return cls(**(values or {}))

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in OBJECTIVE_FIELDS}


def set_objective(draft, objective: ObjectiveConfig | dict | None) -> None:
    """Attach objective settings to ``draft`` (not saved with it) for forwards that only pass training inputs."""
    if isinstance(objective, dict) or objective is None:
        objective = ObjectiveConfig.from_dict(objective)
    object.__setattr__(draft, "_poss_objective", objective)


def get_objective(draft) -> ObjectiveConfig:
    return getattr(draft, "_poss_objective", None) or ObjectiveConfig()


# ---------------------------------------------------------------------------------------------------- attention
def step_attention_mask(step: int, query_start: int, query_end: int, length: int, device) -> tuple[torch.BoolTensor, list]:
    """Bool mask and key ranges for the queries ``query_start .. query_end - 1`` of step ``step``.

    Keys are laid out block by block: block 0 holds the target pairs at positions ``[0, query_end - step)``, block
    j >= 1 the step-j rows at positions ``[max(0, query_start - step + j), query_end - step + j)``.

    Returns:
        mask (`[1, 1, Q, K_total]`): query t sees block-0 keys at positions <= t - step and the block-j key at
            exactly position t - step + j.
        ranges: list of ``(block, start, end)`` key ranges, in key order.
    """
    queries = torch.arange(query_start, query_end, device=device)[:, None]
    ranges, parts = [], []
    end0 = max(0, query_end - step)
    ranges.append((0, 0, end0))
    parts.append(torch.arange(0, end0, device=device)[None, :] <= queries - step)
    for j in range(1, step + 1):
        start, end = max(0, query_start - step + j), min(length, query_end - step + j)
        ranges.append((j, start, end))
        parts.append(torch.arange(start, end, device=device)[None, :] == queries - step + j)
    return torch.cat(parts, dim=1)[None, None], ranges


def _step_attention(layer, rows, pos_emb, kv_blocks, step, chunk_size):
    """Output `[B, T, H]` of ``layer`` for the step-``step`` rows, attending as described in the module docstring."""
    hidden = rows[step]
    length = hidden.shape[1]
    cos, sin = pos_emb
    if step == 0:
        keys, values = kv_blocks[0]
        mask = step_attention_mask(0, 0, length, length, hidden.device)[0]
        return layer(hidden, pos_emb, keys, values, mask)
    outputs = []
    for start in range(0, length, chunk_size):
        end = min(length, start + chunk_size)
        mask, ranges = step_attention_mask(step, start, end, length, hidden.device)
        keys = torch.cat([kv_blocks[j][0][:, :, a:b] for j, a, b in ranges], dim=2)
        values = torch.cat([kv_blocks[j][1][:, :, a:b] for j, a, b in ranges], dim=2)
        chunk_emb = (cos[:, start:end], sin[:, start:end])
        outputs.append(layer(hidden[:, start:end], chunk_emb, keys, values, mask))
    return torch.cat(outputs, dim=1)


def _add_noise(features: torch.Tensor, objective: ObjectiveConfig) -> torch.Tensor:
    if objective.noise == "none" or objective.noise_scale == 0:
        return features
    if objective.noise == "uniform":
        return features + (torch.rand_like(features) - 0.5) * objective.noise_scale
    return features + torch.randn_like(features) * objective.noise_scale


def unroll(draft, input_ids, target_hidden_states, num_steps: int, chunk_size: int = 256) -> list[torch.Tensor]:
    """Run the K unrolled steps; returns ``[out^0, ..., out^{K-1}]``, each `[B, T, H]`.

    Args:
        input_ids (`[B, T]`): x_{t+1} of each pair.
        target_hidden_states (`[B, T, H]`): f_t of each pair (noise already applied if any).
    """
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
    rows = [draft.fuse(input_ids, target_hidden_states)]  # rows[j]: fused inputs of step j, [B, T, H]
    pos_emb = draft.position_embeddings(rows[0], positions)
    kv_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    outputs = []
    for step in range(num_steps):
        specialist = draft.config.specialist_for_step(step)
        layer = draft.layers[specialist]
        if step > 0:
            previous = outputs[-1].detach()
            shifted = torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1)
            rows.append(draft.fuse(input_ids, shifted))
        blocks = []
        for j in range(step + 1):
            if (specialist, j) not in kv_cache:
                kv_cache[(specialist, j)] = layer.project_kv(rows[j], pos_emb)
            blocks.append(kv_cache[(specialist, j)])
        if getattr(draft, "_poss_checkpoint_layers", False) and torch.is_grad_enabled():
            out = checkpoint(_step_attention, layer, rows, pos_emb, blocks, step, chunk_size, use_reentrant=False)
        else:
            out = _step_attention(layer, rows, pos_emb, blocks, step, chunk_size)
        outputs.append(out)
    return outputs


# ---------------------------------------------------------------------------------------------------- loss
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


def _topk_ce(target_logp: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row cross-entropy `[M]` restricted to the target's top-k tokens (HASS distillation term)."""
    top_logp, top_idx = target_logp.topk(min(k, target_logp.shape[-1]), dim=-1)
    draft_logp = torch.log_softmax(logits, dim=-1)
    return -(top_logp.exp() * draft_logp.gather(-1, top_idx)).sum(-1)


def _step_masks(loss_mask: torch.Tensor, num_steps: int) -> list[torch.BoolTensor]:
    """Step-k masks `[B, T]`: the loss mask without the last pair (no target) and without positions t < k."""
    mask = loss_mask.bool().clone()
    mask[:, -1] = False
    positions = torch.arange(mask.shape[1], device=mask.device)[None]
    return [mask & (positions >= k) for k in range(num_steps)]


def _chain_counts(correct_maps, masks):
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


def training_forward(draft, input_ids, target_hidden_states, loss_mask, objective=None, num_items_in_batch=None,
                     return_step_features: bool = False, **overrides):
    """Loss of the multi-step objective; called by ``PosSDraftModel.forward`` when training inputs are given.

    Args:
        input_ids (`[B, T]`): x_{t+1} per pair.
        target_hidden_states (`[B, T, H]`): f_t per pair (f_{t+1} of the next pair is the regression target).
        loss_mask (`[B, T]`): 1 where pair t's prediction is trained.
        objective ([`ObjectiveConfig`] or `dict`, *optional*): settings; default: those attached with
            [`set_objective`], else the defaults. ``overrides`` replace single fields.
        num_items_in_batch: accepted for Trainer compatibility and ignored (the loss is a per-batch mean).
        return_step_features (`bool`): also return the step outputs in ``metrics["step_features"]``.

    Returns:
        [`PosSDraftOutput`] with ``loss`` (scalar), ``last_hidden_state`` (step-0 output) and ``metrics``: per draft
        depth d = k + 1, ``loss_d``, ``acc_d`` (top-1 agreement with the target) and counts for aggregation.
    """
    from ..modeling_poss import PosSDraftOutput

    if isinstance(objective, dict):
        objective = ObjectiveConfig.from_dict(objective)
    objective = objective or get_objective(draft)
    if overrides:
        objective = ObjectiveConfig.from_dict({**objective.to_dict(), **overrides})
    num_steps = objective.num_unrolled_steps or draft.config.training_depth
    weights = objective.step_weights or [1.0] * num_steps
    if len(weights) != num_steps:
        raise ValueError(f"step_weights has {len(weights)} entries for {num_steps} steps.")

    features = target_hidden_states.to(draft.fc.weight.dtype)
    inputs = _add_noise(features, objective) if draft.training else features
    outputs = unroll(draft, input_ids, inputs, num_steps, objective.attention_chunk_size)

    masks = _step_masks(loss_mask, num_steps)
    next_features = torch.cat([features[:, 1:], torch.zeros_like(features[:, :1])], dim=1).detach()
    base = masks[0]  # every step's rows are a subset of these M0 rows; other rows get weight 0
    pred_rows = next_features[base]  # [M0, H]
    with torch.no_grad():
        target_logits = draft.compute_logits(pred_rows).float()  # [M0, V]
        target_probs = torch.softmax(target_logits, dim=-1)
        target_top1 = target_logits.argmax(-1)
        target_logp = torch.log_softmax(target_logits, dim=-1) if objective.topk_weight else None
        del target_logits

    loss = features.new_zeros((), dtype=torch.float32)
    metrics, correct_maps = {}, []
    for k, (out, mask) in enumerate(zip(outputs, masks)):
        weight = mask[base].float()  # [M0]
        count = mask.sum()
        denom = count.clamp(min=1).float()
        pred = out[base]
        feature_rows = F.smooth_l1_loss(pred.float(), pred_rows.float(), reduction="none").mean(-1)
        feature_loss = (feature_rows * weight).sum() / denom
        logits = draft.compute_logits(pred).float()
        ce_loss = (SoftCrossEntropy.apply(logits, target_probs) * weight).sum() / denom
        step_loss = objective.feature_weight * feature_loss + objective.ce_weight * ce_loss
        if objective.topk_weight:
            topk_rows = _topk_ce(target_logp, logits, objective.topk)
            step_loss = step_loss + objective.topk_weight * (topk_rows * weight).sum() / denom
        loss = loss + weights[k] * step_loss
        with torch.no_grad():
            hits = (logits.argmax(-1) == target_top1) & weight.bool()
            correct = torch.zeros_like(mask)
            correct[base] = hits
            correct_maps.append(correct)
            depth = k + 1
            metrics[f"loss_{depth}"] = step_loss.detach()
            metrics[f"feature_loss_{depth}"] = feature_loss.detach()
            metrics[f"ce_{depth}"] = ce_loss.detach()
            metrics[f"acc_{depth}"] = hits.float().sum() / denom
            metrics[f"correct_{depth}"] = hits.sum()
            metrics[f"count_{depth}"] = count
    with torch.no_grad():
        numerator, denominator = _chain_counts(correct_maps, masks)
        for k in range(num_steps):
            metrics[f"chain_accepted_{k + 1}"] = numerator[k]
            metrics[f"chain_reached_{k + 1}"] = denominator[k]
    if return_step_features:
        metrics["step_features"] = outputs
    return PosSDraftOutput(loss=loss, last_hidden_state=outputs[0], metrics=metrics)
