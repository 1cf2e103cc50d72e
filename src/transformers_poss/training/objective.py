"""The multi-step (HASS-aligned) training objective of PosS drafts.

Conventions (one sequence of tokens x_0 .. x_{T} with target features f_0 .. f_{T}):

- ``input_ids[:, t]`` is x_{t+1} and ``target_hidden_states[:, t]`` is f_t: pair t = (f_t, x_{t+1}). A draft with
  ``config.feature_layers`` reads k target layers at t (`[.., k * H]`), fused to H by ``draft.fuse_target_features``;
  only these target inputs are fused, later steps feed the draft's own H-wide outputs.
- The regression target of pair t is the post-norm feature f_{t+1} (``target_last_hidden_state[:, t + 1]``, which is
  ``target_hidden_states`` for single-feature drafts; the last pair has none); the soft labels are the target's
  ``lm_head`` of it.
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
  step's mask and divided by their count, times the step's weight (``step_weights``, else ``step_weight_decay ** k``).
  Positions t < k have no full context and are never trained. ``feature_weight: 0`` drops the regression (it is not
  computed): the token loss alone.

The unrolled steps are EAGLE-3's "training-time test" (each step feeds the draft's own previous predictions). The
EAGLE-3 objective is `EAGLE3_OBJECTIVE`: token loss only (``feature_weight`` 0, ``ce_weight`` 1), step weights
0.8 ** k, with ``num_unrolled_steps`` steps (EAGLE-3: 7; the SmolLM2 recipe: 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..modeling_poss_layers import BlockCausalMask
from .losses import (HeadSoftCrossEntropy, SoftCrossEntropy, SoftLabels, chain_counts, head_chunk_rows,
                     topk_cross_entropy)

__all__ = ["ObjectiveFields", "ObjectiveConfig", "EAGLE3_OBJECTIVE", "check_objective", "set_objective",
           "get_objective", "unroll", "training_forward", "step_attention_mask", "step_loss_weights", "SoftCrossEntropy",
           "soft_label_logits"]

ATTENTION_CHUNK_SIZE = 64  # queries per attention call in the unrolled steps >= 1 (`ObjectiveFields`)


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
        step_weights (`list[float]`, *optional*): per-step loss weights (default: ``step_weight_decay ** k``).
        step_weight_decay (`float`): weight of step k is ``step_weight_decay ** k`` when ``step_weights`` is unset
            (1.0: every step 1.0, the PosS / HASS objective; EAGLE-3: 0.8).
        soft_label_autocast (`bool`): in training under autocast (bf16 on CPUs with bf16 units and on GPUs), the
            target's logits that give the soft labels are computed under it too, as EAGLE's reference code does with
            its half-precision target (their softmax stays float32); False computes them in float32. Evaluation always
            uses float32 soft labels.
        attention_chunk_size (`int`): queries per attention call in steps >= 1 (exact either way). A chunk of ``C``
            queries also reads the ``C``-wide slices of every drafted-row block, of which each query sees one key, so
            smaller chunks waste less: 64 trains a 6-step draft about 1.18x faster than 256 on a 2-core CPU
            (docs/training.md).
    """

    num_unrolled_steps: int | None = field(default=None, metadata={"help": "Unrolled steps (default: training_depth)."})
    feature_weight: float = field(default=1.0, metadata={"help": "SmoothL1 feature loss weight."})
    ce_weight: float = field(default=0.1, metadata={"help": "Soft cross-entropy weight."})
    topk_weight: float = field(default=0.0, metadata={"help": "HASS top-k distillation weight."})
    topk: int = field(default=10, metadata={"help": "Tokens of the top-k term."})
    noise: str = field(default="uniform", metadata={"help": "Input-feature noise: uniform, gaussian or none."})
    noise_scale: float = field(default=0.05, metadata={"help": "Uniform noise width or gaussian std."})
    step_weights: list[float] | None = field(
        default=None, metadata={"help": "Loss weight of each unrolled step (default: step_weight_decay ** k)."}
    )
    step_weight_decay: float = field(
        default=1.0, metadata={"help": "Step k's loss weight: decay ** k, unless step_weights (EAGLE-3: 0.8)."}
    )
    soft_label_autocast: bool = field(
        default=True, metadata={"help": "Training soft labels under the step's autocast (bf16 where on); false: fp32."}
    )
    attention_chunk_size: int = field(
        default=ATTENTION_CHUNK_SIZE,
        metadata={"help": "Queries per attention call in unrolled steps >= 1 (exact either way)."},
    )


def check_objective(settings: ObjectiveFields) -> None:
    """Clear errors for objective settings that cannot work."""
    if settings.noise not in ("uniform", "gaussian", "none"):
        raise ValueError(f"noise must be 'uniform', 'gaussian' or 'none', got {settings.noise!r}.")
    if settings.step_weights is not None and any(w < 0 for w in settings.step_weights):
        raise ValueError(f"step_weights must be >= 0, got {settings.step_weights}.")
    if not settings.step_weight_decay > 0:
        raise ValueError(f"step_weight_decay must be > 0 (1.0: equal steps; EAGLE-3: 0.8), got "
                         f"{settings.step_weight_decay}.")
    for name in ("feature_weight", "ce_weight", "topk_weight"):
        if getattr(settings, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(settings, name)}.")
    if settings.feature_weight == 0 and settings.ce_weight == 0 and settings.topk_weight == 0:
        raise ValueError("feature_weight, ce_weight and topk_weight are all 0: nothing would be trained.")


def step_loss_weights(settings: ObjectiveFields, num_steps: int) -> list[float]:
    """The loss weight of each of ``num_steps`` unrolled steps: ``step_weights``, else ``step_weight_decay ** k``."""
    if settings.step_weights is not None:
        if len(settings.step_weights) != num_steps:
            raise ValueError(f"step_weights has {len(settings.step_weights)} entries for {num_steps} steps.")
        return [float(w) for w in settings.step_weights]
    return [settings.step_weight_decay ** k for k in range(num_steps)]


# EAGLE-3's objective (token loss only, geometric step weights): ``ObjectiveConfig(**EAGLE3_OBJECTIVE,
# num_unrolled_steps=K)``, or these three settings in a `poss train` recipe.
EAGLE3_OBJECTIVE = {"feature_weight": 0.0, "ce_weight": 1.0, "step_weight_decay": 0.8}


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
    if step == 0:  # causal over the pairs: in query blocks on CPUs (2-3x SDPA's CPU kernel), SDPA elsewhere
        keys, values = kv_blocks[0]
        on_cpu = hidden.device.type == "cpu"
        mask = BlockCausalMask() if on_cpu else step_attention_mask(0, 0, length, length, hidden.device)[0]
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


def unroll(draft, input_ids, target_hidden_states, num_steps: int,
           chunk_size: int = ATTENTION_CHUNK_SIZE) -> list[torch.Tensor]:
    """Run the K unrolled steps; returns ``[out^0, ..., out^{K-1}]``, each `[B, T, H]`.

    Args:
        input_ids (`[B, T]`): x_{t+1} of each pair.
        target_hidden_states (`[B, T, k * H]`): the target features of each pair (f_t for k = 1; noise already
            applied if any).
    """
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
    # rows[j]: fused inputs of step j, [B, T, config.fused_size]; target features are fused to H first
    rows = [draft.fuse(input_ids, draft.fuse_target_features(target_hidden_states))]
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
def _step_masks(loss_mask: torch.Tensor, num_steps: int) -> list[torch.BoolTensor]:
    """Step-k masks `[B, T]`: the loss mask without the last pair (no target) and without positions t < k."""
    mask = loss_mask.bool().clone()
    mask[:, -1] = False
    positions = torch.arange(mask.shape[1], device=mask.device)[None]
    return [mask & (positions >= k) for k in range(num_steps)]


def soft_label_logits(draft, features: torch.Tensor) -> torch.Tensor:
    """The TARGET's logits `[..., V']` over the drafting vocabulary of `[..., H]` target post-norm features: the
    soft labels. The target's lm_head rows, never the draft's final norm (``eagle3`` style) or own lm_head."""
    if not getattr(draft, "is_attached", False):
        raise RuntimeError("Training needs the target attached (`draft.attach_target(target)`): its lm_head gives "
                           "the soft labels.")
    return draft.target_logits(features)


def _soft_cross_entropy(draft, pred, target_probs, head):
    """Per-row soft cross-entropy `[M]` of the draft's logits of ``pred`` `[M, H]` under ``target_probs`` and the
    draft's top-1 `[M]`; with ``head`` (``draft.logits_head()``): head and softmax in chunks of rows
    ([`HeadSoftCrossEntropy`], no logits returned), else through the whole float32 logits (also returned, for the
    top-k term)."""
    if head is None:
        if isinstance(target_probs, SoftLabels):
            target_probs = target_probs.store(head_chunk_rows(target_probs.weight.shape[0])).probs
        logits = draft.compute_logits(pred).float()
        return SoftCrossEntropy.apply(logits, target_probs), logits.detach().argmax(-1), logits
    weight, bias = head
    features = pred if draft.norm is None else draft.norm(pred.to(draft.norm.weight.dtype))
    device = features.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else features.dtype
    rows, top1 = HeadSoftCrossEntropy.apply(features, weight, bias, target_probs, dtype,
                                            head_chunk_rows(weight.shape[0]))
    return rows, top1, None


def _check_widths(draft, target_hidden_states, target_last_hidden_state):
    """Clear errors for features that are not the ones this draft reads (multi-layer vs post-norm features)."""
    config = draft.config
    layers = config.feature_layers
    if target_hidden_states.shape[-1] != config.target_feature_size:
        wanted = f"feature_layers={list(layers)} ({len(layers)} x {config.hidden_size})" if layers else \
            f"the post-norm feature ({config.hidden_size})"
        raise ValueError(f"target_hidden_states are {target_hidden_states.shape[-1]} wide, but this draft reads "
                         f"{wanted}: compute features for its layers (TargetFeatures(target, "
                         "draft.config.feature_layers), write_feature_shards(..., feature_layers=...)).")
    if layers and target_last_hidden_state is None:
        raise ValueError("A draft with feature_layers needs `target_last_hidden_state` (the target's post-norm "
                         "features [B, T, H]) for its token loss; PosSDataCollator / TargetFeatures.draft_inputs "
                         "provide it.")
    if target_last_hidden_state is not None and target_last_hidden_state.shape[-1] != config.hidden_size:
        raise ValueError(f"target_last_hidden_state must be [B, T, {config.hidden_size}] (the target's post-norm "
                         f"features), got {tuple(target_last_hidden_state.shape)}.")


def training_forward(draft, input_ids, target_hidden_states, loss_mask, objective=None, num_items_in_batch=None,
                     return_step_features: bool = False, target_last_hidden_state=None, **overrides):
    """Loss of the multi-step objective; called by ``PosSDraftModel.forward`` when training inputs are given.

    Args:
        input_ids (`[B, T]`): x_{t+1} per pair.
        target_hidden_states (`[B, T, k * H]`): the target features the draft reads per pair (f_t for k = 1).
        target_last_hidden_state (`[B, T, H]`, *optional*): the target's post-norm features f_t (f_{t+1} of the next
            pair is the regression target, its lm_head the soft labels); required with ``feature_layers``, else
            ``target_hidden_states`` is that feature.
        loss_mask (`[B, T]`): 1 where pair t's prediction is trained.
        objective ([`ObjectiveConfig`] or `dict`, *optional*): settings; default: those attached with
            [`set_objective`], else the defaults. ``overrides`` replace single fields.
        num_items_in_batch: accepted for Trainer compatibility and ignored (the loss is a per-batch mean).
        return_step_features (`bool`): also return the step outputs in ``metrics["step_features"]``.

    Returns:
        [`PosSDraftOutput`] with ``loss`` (scalar), ``last_hidden_state`` (step-0 output) and ``metrics``: per draft
        depth d = k + 1, ``loss_d``, ``acc_d`` (top-1 agreement with the target) and counts for aggregation.
    """
    from ..modeling_outputs import PosSDraftOutput

    if isinstance(objective, dict):
        objective = ObjectiveConfig.from_dict(objective)
    objective = objective or get_objective(draft)
    if overrides:
        objective = ObjectiveConfig.from_dict({**objective.to_dict(), **overrides})
    num_steps = objective.num_unrolled_steps or draft.config.training_depth
    weights = step_loss_weights(objective, num_steps)
    _check_widths(draft, target_hidden_states, target_last_hidden_state)

    features = target_hidden_states.to(draft.dtype)
    post_norm = features if target_last_hidden_state is None else target_last_hidden_state.to(draft.dtype)
    inputs = _add_noise(features, objective) if draft.training else features
    outputs = unroll(draft, input_ids, inputs, num_steps, objective.attention_chunk_size)

    masks = _step_masks(loss_mask, num_steps)
    next_features = torch.cat([post_norm[:, 1:], torch.zeros_like(post_norm[:, :1])], dim=1).detach()
    base = masks[0]  # every step's rows are a subset of these M0 rows; other rows get weight 0
    pred_rows = next_features[base]  # [M0, H]
    # soft labels: under the step's autocast in training when soft_label_autocast (a bf16 product is 3-4x a float32
    # one on CPUs with bf16 units), float32 otherwise and always in evaluation; their softmax is float32 either way
    device_type = pred_rows.device.type
    labels_autocast = objective.soft_label_autocast and draft.training and torch.is_autocast_enabled(device_type)
    head = None if objective.topk_weight else draft.logits_head()  # the top-k term needs the whole logits
    label_head = None if head is None else draft.target_head()
    if label_head is not None:  # labels chunk by chunk beside the fused loss; kept only if several steps read them
        dtype = torch.get_autocast_dtype(device_type) if labels_autocast else label_head[0].dtype
        target_probs = SoftLabels(pred_rows, *label_head, dtype)
        if num_steps > 1:
            target_probs.store(head_chunk_rows(label_head[0].shape[0]))
        target_top1 = target_probs.top1  # complete once the first step's loss has read every row
    else:
        with torch.no_grad(), torch.autocast(device_type=device_type, enabled=labels_autocast):  # the step's dtype
            target_logits = soft_label_logits(draft, pred_rows).float()  # [M0, V']
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
        if objective.feature_weight:
            feature_rows = F.smooth_l1_loss(pred.float(), pred_rows.float(), reduction="none").mean(-1)
            feature_loss = (feature_rows * weight).sum() / denom
        else:  # token loss only: the regression is not computed
            feature_loss = loss.new_zeros(())
        ce_rows, draft_top1, logits = _soft_cross_entropy(draft, pred, target_probs, head)
        ce_loss = (ce_rows * weight).sum() / denom
        step_loss = objective.feature_weight * feature_loss + objective.ce_weight * ce_loss
        if objective.topk_weight:
            topk_rows = topk_cross_entropy(target_logp, logits, objective.topk)
            step_loss = step_loss + objective.topk_weight * (topk_rows * weight).sum() / denom
        loss = loss + weights[k] * step_loss
        with torch.no_grad():
            hits = (draft_top1 == target_top1) & weight.bool()
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
        numerator, denominator = chain_counts(correct_maps, masks)
        for k in range(num_steps):
            metrics[f"chain_accepted_{k + 1}"] = numerator[k]
            metrics[f"chain_reached_{k + 1}"] = denominator[k]
    if return_step_features:
        metrics["step_features"] = outputs
    return PosSDraftOutput(loss=loss, last_hidden_state=outputs[0], metrics=metrics)
