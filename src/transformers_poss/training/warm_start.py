"""Starting a draft from a trained one (the paper's recipe): `init_specialists`, and the EAGLE-2 -> multi-layer warm
start.

- Same feature layout (both single-feature, or both reading the same ``feature_layers``): every specialist layer,
  and every module outside the layers that both drafts have (``fc``, ``feature_fc``, norms, an own head or embedding)
  and the reduced-vocabulary map are copied. A one-specialist source starts every specialist.
- A single-feature (EAGLE-2 / HASS / PosS) source into a draft with ``feature_layers``: the layers and ``fc`` are
  copied and ``feature_fc`` (k * H -> H) is set so that the fused feature starts close to the post-norm feature the
  source was trained on: ``"identity"`` on the slot of the highest selected layer (zeros elsewhere), or ``"fit"``
  (`fit_feature_fc`: least squares from stored features onto the post-norm feature). This is a warm start, not an
  equivalence: the two drafts compute the same function only when the post-norm layer is selected (identity, or a
  fit without residual); from intermediate layers the fused feature is the best linear stand-in, which training
  then improves. Prefer the fit there: intermediate hidden states are not normalised (on SmolLM2 layer 27's are
  ~10x the post-norm feature's norm), so the identity start drafts nothing useful (top-1 agreement 0.00 at depth 1
  with the EAGLE-2 draft's layer, against 0.58 after a fit on 11k tokens and 0.67 for the EAGLE-2 draft itself).

- A wider MLP (``intermediate_size`` above the source's): each layer's gate and up rows and down columns are copied
  into the first units and the new down columns start at zero, so the new draft computes exactly the source's
  function and training grows the new units from there (`grow_mlp`).

Other sources are refused with a message (another target's shape, a narrower MLP, another layer style, other
feature layers, a multi-layer source into a single-feature draft).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .feature_inputs import describe_layers, draft_feature_layers

logger = logging.get_logger(__name__)

__all__ = ["init_specialists", "is_warm_start", "load_source", "set_feature_fc_identity", "fit_feature_fc",
           "feature_pairs", "grow_mlp"]

_SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")


def load_source(source):
    """A source draft: a model, a saved draft folder, or an official (EAGLE / HASS / PosS) checkpoint."""
    if not isinstance(source, str):
        return source
    from ..modeling_poss import PosSDraftModel

    try:
        return PosSDraftModel.from_pretrained(source)
    except (OSError, ValueError, KeyError):
        return PosSDraftModel.from_official(source, positions_per_specialist=1)


def is_warm_start(draft, source) -> bool:
    """Raise for a source that cannot start ``draft``; True for the single-feature -> ``feature_layers`` warm
    start, False for the same feature layout."""
    mine, theirs = draft.config, source.config
    for name in _SHAPE_FIELDS:
        if getattr(mine, name, None) != getattr(theirs, name, None):
            raise ValueError(f"Cannot initialise from a draft with {name}={getattr(theirs, name, None)} "
                             f"(this draft has {getattr(mine, name, None)}): both must be drafts for the same target.")
    if mine.intermediate_size < theirs.intermediate_size:
        raise ValueError(f"Cannot initialise an MLP of intermediate_size={mine.intermediate_size} from a draft with "
                         f"intermediate_size={theirs.intermediate_size}: a draft can start from one as wide or narrower "
                         "(set intermediate_size to at least the source's).")
    style, source_style = getattr(mine, "layer_style", "eagle2"), getattr(theirs, "layer_style", "eagle2")
    if style != source_style:
        raise ValueError(f"Cannot initialise {style!r} layers from a draft with {source_style!r} layers: start from a "
                         "draft of the same layer_style.")
    layers, source_layers = draft_feature_layers(draft), draft_feature_layers(source)
    if layers == source_layers:
        return False
    if source_layers is None:
        return True
    raise ValueError(f"Cannot initialise a draft reading {describe_layers(layers)} from one reading "
                     f"{describe_layers(source_layers)}: start from a draft with the same feature_layers, or from a "
                     "single-feature (EAGLE-2) draft, which is a warm start.")


@torch.no_grad()
def set_feature_fc_identity(draft) -> None:
    """``feature_fc`` = identity on the slot of the highest selected layer, zeros elsewhere: the fused feature is
    that hidden state (exactly the post-norm feature when the post-norm layer is selected)."""
    layers = draft_feature_layers(draft)
    hidden = draft.config.hidden_size
    slot = layers.index(max(layers))
    weight = draft.feature_fc.weight
    weight.zero_()
    weight[:, slot * hidden : (slot + 1) * hidden] = torch.eye(hidden, dtype=weight.dtype, device=weight.device)
    if getattr(draft.feature_fc, "bias", None) is not None:
        draft.feature_fc.bias.zero_()


def feature_pairs(dataset, draft, target=None, max_tokens: int = 32768, batch_size: int = 8):
    """Up to ``max_tokens`` rows ``(features [N, k * H], post-norm features [N, H])`` of the layers ``draft`` reads,
    from the first items of a dataset: stored features ([`FeatureShardDataset`]) or, with ``target``, tokenized
    items run through it."""
    from .feature_inputs import PosSDataCollator, TargetFeatures

    compute = None
    taken = 0
    for start in range(0, len(dataset), batch_size):
        if taken >= max_tokens:
            return
        items = [dataset[i] for i in range(start, min(len(dataset), start + batch_size))]
        if "hidden_states" in items[0]:
            rows = [(torch.as_tensor(i["hidden_states"]), torch.as_tensor(i["last_hidden_state"])) for i in items]
        else:
            if target is None:
                raise ValueError("feature_pairs needs stored features or `target=` to compute them.")
            compute = compute or TargetFeatures(target, draft_feature_layers(draft))
            batch = PosSDataCollator()(items)
            device = next(target.parameters()).device
            features, last = compute.compute(batch["tokens"].to(device), batch["attention_mask"].to(device))
            rows = [(features[r, : len(i["input_ids"])].cpu(), last[r, : len(i["input_ids"])].cpu())
                    for r, i in enumerate(items)]
        for x, y in rows:
            x, y = x[: max_tokens - taken], y[: max_tokens - taken]
            taken += x.shape[0]
            yield x, y


@torch.no_grad()
def fit_feature_fc(draft, pairs, ridge: float = 1e-4) -> float:
    """Set ``feature_fc`` to the least-squares map of target features onto the post-norm feature.

    Args:
        pairs: iterable of ``(features [N, k * H], post-norm features [N, H])`` (e.g. `feature_pairs`).
        ridge: Tikhonov term, relative to the mean diagonal of the normal matrix (keeps collinear layers stable
            and the fit general: on SmolLM2's layers [2, 15, 27], 11k tokens, held-out R^2 0.80 at 1e-6, 0.82 at
            1e-4).
    Returns:
        the share of the post-norm features' variance the fused feature explains (R^2; 1.0 when the post-norm layer
        is selected).
    """
    width = draft.feature_fc.weight.shape[1]
    gram = torch.zeros(width, width, dtype=torch.float64)
    cross = torch.zeros(width, draft.config.hidden_size, dtype=torch.float64)
    y_sum = torch.zeros(draft.config.hidden_size, dtype=torch.float64)
    y_square, count = 0.0, 0
    for x, y in pairs:
        x, y = x.to(torch.float64), y.to(torch.float64)
        gram += x.T @ x
        cross += x.T @ y
        y_sum += y.sum(0)
        y_square += float((y * y).sum())
        count += x.shape[0]
    if count == 0:
        raise ValueError("fit_feature_fc got no feature rows.")
    scale = float(gram.diagonal().mean()) or 1.0
    solution = torch.linalg.solve(gram + ridge * scale * torch.eye(width, dtype=torch.float64), cross)  # [k*H, H]
    # residual sum of squares from the normal equations: |y|^2 - 2 <W, X^T y> + <W, X^T X W>
    residual = y_square - 2 * float((solution * cross).sum()) + float((solution * (gram @ solution)).sum())
    total = y_square - float((y_sum * y_sum).sum()) / count
    weight = draft.feature_fc.weight
    weight.copy_(solution.T.to(weight.dtype))
    if getattr(draft.feature_fc, "bias", None) is not None:
        draft.feature_fc.bias.zero_()
    return 1.0 - residual / total if total > 0 else 1.0


def grow_mlp(source_layer: dict, layer: dict) -> dict:
    """A layer's state dict with the source layer's MLP in the first units of a wider one.

    Args:
        source_layer: the trained layer's state dict (``mlp.gate_proj.weight`` / ``mlp.up_proj.weight`` ``[I_s, H]``,
            ``mlp.down_proj.weight`` ``[H, I_s]``).
        layer: the wider layer's state dict (``[I, H]`` / ``[H, I]``, ``I > I_s``), whose new gate and up rows are
            kept as initialised.
    Returns:
        ``source_layer`` with the MLP weights widened: gate / up rows ``[:I_s]`` and down columns ``[:I_s]`` from the
        source, down columns ``[I_s:]`` zero, so the layer's output is the source's exactly. The new units get a
        gradient through their down columns from the first step.
    """
    grown = dict(source_layer)
    for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        rows = layer[name].clone()
        rows[: source_layer[name].shape[0]] = source_layer[name]
        grown[name] = rows
    down = torch.zeros_like(layer["mlp.down_proj.weight"])
    down[:, : source_layer["mlp.down_proj.weight"].shape[1]] = source_layer["mlp.down_proj.weight"]
    grown["mlp.down_proj.weight"] = down
    return grown


def inherit_tree_settings(draft, source) -> dict:
    """Give ``draft`` the draft-tree settings ``source`` was saved with (every ``tree_*`` field of its
    ``generation_config``: shape, budget, context candidates), so that a draft continued from a saved one drafts as
    that one did; returns what was set.

    The depth is at least ``draft``'s training depth: a six-step PosS draft started from a one-step EAGLE-2 draft
    saved with ``tree_depth=1`` would otherwise never draft the positions its specialists were trained for.
    """
    settings = {k: v for k, v in source.generation_config.to_dict().items()
                if k.startswith("tree_") and k != "tree_record_rounds"}
    depth = draft.config.training_depth
    if isinstance(settings.get("tree_depth"), int) and settings["tree_depth"] < depth:
        logger.info("tree_depth %d of the source raised to this draft's training depth %d", settings["tree_depth"],
                    depth)
        settings["tree_depth"] = depth
    for key, value in settings.items():
        setattr(draft.generation_config, key, value)
    return settings


@torch.no_grad()
def init_specialists(draft, source, copy_fc: bool = True, copy_token_map: bool = True, feature_fc: str = "identity"):
    """Initialise ``draft``'s specialists from ``source``: a trained draft (or its folder, or an official checkpoint).

    Specialist i gets source layer ``min(i, S_source - 1)``. When ``copy_fc``, the modules outside the layers that
    both drafts have are copied too (``fc``, ``feature_fc``, norms, ...); when ``copy_token_map``, the source's
    reduced-vocabulary map (its ``draft_to_target``), so the new draft drafts over exactly the tokens its layers were
    trained on. A single-feature source into a draft with ``feature_layers`` is a warm start (module docstring):
    ``feature_fc`` is set by ``feature_fc="identity"`` here; ``"fit"`` is done by the caller with `fit_feature_fc`
    (it needs data), and ``"keep"`` leaves it as initialised.
    """
    source = load_source(source)
    warm = is_warm_start(draft, source)
    if feature_fc not in ("identity", "fit", "keep"):
        raise ValueError(f"feature_fc must be 'identity', 'fit' or 'keep', got {feature_fc!r}.")
    for i, layer in enumerate(draft.layers):
        theirs = source.layers[min(i, len(source.layers) - 1)].state_dict()
        if draft.config.intermediate_size > source.config.intermediate_size:
            theirs = grow_mlp(theirs, layer.state_dict())
        layer.load_state_dict(theirs)
    if copy_fc:
        theirs = source.state_dict()
        shared = {k: v for k, v in draft.state_dict().items() if not k.startswith("layers.") and k != "draft_to_target"}
        missing = [k for k in shared if k not in theirs and not (warm and k.startswith("feature_fc."))]
        if missing:
            raise ValueError(f"The source draft has no {', '.join(sorted(missing))}: it cannot start this draft (they "
                             "would stay random); start from a draft with the same modules (own_lm_head, "
                             "own_embeddings).")
        unused = [k for k in theirs if not k.startswith("layers.") and k != "draft_to_target" and k not in shared]
        if unused:
            logger.warning("init_specialists: the source's %s are not used by this draft.", ", ".join(sorted(unused)))
        for key, value in shared.items():
            if key not in theirs:
                continue
            if theirs[key].shape != value.shape:
                raise ValueError(f"Cannot initialise {key} {tuple(value.shape)} from the source's "
                                 f"{tuple(theirs[key].shape)}.")
            value.copy_(theirs[key])
        if warm and feature_fc == "identity":
            set_feature_fc_identity(draft)
    if copy_token_map and getattr(source, "draft_to_target", None) is not None:
        from ..vocab import set_token_map

        set_token_map(draft, source.draft_to_target.detach().cpu())
    return draft
