"""Import of released EAGLE-3 checkpoints (SafeAILab/EAGLE, SpecForge; the layout vLLM and SGLang load as ``eagle3``).

Layout: a Llama-style ``config.json`` (``draft_vocab_size``, optionally ``target_hidden_size``, the target layers in
``eagle_aux_hidden_state_layer_ids`` or ``eagle_config.eagle_aux_hidden_state_layer_ids``, else EAGLE-3's default
``[2, L // 2, L - 3]`` of the target's L layers) and flat keys:

- ``midlayer.self_attn.{q,k,v}_proj.weight`` `[heads * head_dim, 2H]`, ``midlayer.self_attn.o_proj.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``;
- ``fc.weight`` `[H, k*H]` (fuses the k target hidden states), ``norm.weight`` (before the head), ``lm_head.weight``
  `[draft_vocab, H]`;
- ``d2t`` `[draft_vocab]` offsets (target id = draft id + ``d2t[draft id]``), ``t2d`` `[vocab]` bool (which target
  tokens the draft vocabulary holds); sometimes ``embed_tokens.weight``.

They map onto a one-specialist ``layer_style="eagle3"`` draft: ``midlayer.*`` -> ``layers.0.*``, ``fc`` ->
``feature_fc``, ``norm``, ``lm_head`` (``own_lm_head=True``), ``feature_layers`` = the aux layer ids (the same
indices: both count the hidden state entering decoder layer i as i), ``draft_to_target`` = ``arange + d2t``. What
this format cannot represent is refused: a draft hidden size other than the target's, attention / MLP biases,
``norm_before_residual``, no aux hidden states, more than one midlayer, unexpected keys.
"""

from __future__ import annotations

import re

import torch

from .configuration_poss import eagle3_feature_layers

_MIDLAYER_KEY = re.compile(
    r"^midlayer\.(self_attn\.[qkvo]_proj\.weight|mlp\.(gate|up|down)_proj\.weight"
    r"|(input_layernorm|hidden_norm|post_attention_layernorm)\.weight)$"
)
_TOP_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight")
_MIDLAYER_PARTS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
)  # fmt: skip


def is_eagle3_checkpoint(state: dict) -> bool:
    """Whether a flat official state dict is in the EAGLE-3 layout (it has a ``midlayer``)."""
    return any(key.startswith("midlayer.") for key in state)


def _refuse(name: str, reason: str):
    raise ValueError(f"{name} cannot be loaded as a PosS draft: {reason}.")


def check_eagle3_layout(name: str, config: dict, state: dict) -> None:
    """Refuse what the EAGLE-3 import cannot represent exactly (see the module docstring)."""
    unexpected = [k for k in state if not _MIDLAYER_KEY.match(k) and k not in _TOP_KEYS]
    if any(k.startswith("layers.") for k in unexpected) or config.get("num_hidden_layers", 1) > 1:
        _refuse(name, "it has more than one decoder layer (one midlayer is the EAGLE-3 draft this import reads)")
    if unexpected:
        _refuse(name, f"unexpected keys {sorted(unexpected)[:6]} (attention / MLP biases or another architecture)")
    missing = [f"midlayer.{part}" for part in _MIDLAYER_PARTS if f"midlayer.{part}" not in state]
    missing += [k for k in ("fc.weight", "norm.weight") if k not in state]
    if missing:
        _refuse(name, f"keys {missing[:6]} are missing")
    for flag in ("attention_bias", "qkv_bias", "mlp_bias", "norm_before_residual"):
        if config.get(flag):
            _refuse(name, f"its config sets {flag}, which the EAGLE-3 layer of this package does not have")
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    if eagle.get("use_aux_hidden_state") is False:
        _refuse(name, "eagle_config.use_aux_hidden_state is false (a draft without the fused target layers)")
    hidden = config["hidden_size"]
    target_hidden = config.get("target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        _refuse(name, f"its target_hidden_size {target_hidden} differs from its hidden_size {hidden} (drafts here "
                      "work at the target's width)")
    if state["midlayer.self_attn.q_proj.weight"].shape[1] != 2 * hidden:
        _refuse(name, f"midlayer q_proj takes {state['midlayer.self_attn.q_proj.weight'].shape[1]} inputs, "
                      f"EAGLE-3 takes 2 * hidden_size = {2 * hidden}")
    width = state["fc.weight"].shape
    if width[0] != hidden or width[1] % hidden:
        _refuse(name, f"fc.weight has shape {tuple(width)}, expected [{hidden}, k * {hidden}]")


def aux_layer_ids(name: str, config: dict, target, num_features: int) -> list[int]:
    """The target layers of an EAGLE-3 checkpoint: stored aux ids, else EAGLE-3's default for the target."""
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    layers = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    if not layers:
        if target is None:
            _refuse(name, "its config names no target layers (eagle_aux_hidden_state_layer_ids); pass target= so "
                          "that EAGLE-3's default [2, L // 2, L - 3] is taken from the target's layer count")
        layers = eagle3_feature_layers(target.config.get_text_config().num_hidden_layers)
    layers = list(layers)
    if len(layers) != num_features:
        _refuse(name, f"fc.weight fuses {num_features} target hidden states but the aux layer ids are {layers}")
    return layers


def token_map(name: str, state: dict, vocab_size: int) -> torch.LongTensor | None:
    """``draft_to_target`` from ``d2t`` (checked against ``t2d``); None when the draft vocabulary is the full one."""
    head = state.get("lm_head.weight")
    draft_vocab = vocab_size if head is None else head.shape[0]
    d2t = state.get("d2t")
    if d2t is None:
        if draft_vocab != vocab_size:
            _refuse(name, f"its lm_head covers {draft_vocab} tokens of {vocab_size} but there is no d2t map")
        return None
    if d2t.dim() != 1 or d2t.numel() != draft_vocab or d2t.is_floating_point():
        _refuse(name, f"d2t must hold {draft_vocab} integer offsets, got shape {tuple(d2t.shape)} ({d2t.dtype})")
    mapping = torch.arange(draft_vocab) + d2t.to(torch.long)
    if int(mapping.min()) < 0 or int(mapping.max()) >= vocab_size or torch.unique(mapping).numel() != draft_vocab:
        _refuse(name, f"d2t maps draft ids outside the {vocab_size}-token vocabulary or onto the same token twice")
    t2d = state.get("t2d")
    if t2d is not None and (t2d.numel() != vocab_size or int(t2d.bool().sum()) != draft_vocab
                            or not bool(t2d.bool()[mapping].all())):  # fmt: skip
        _refuse(name, "its t2d does not mark exactly the target tokens d2t maps to")
    if draft_vocab == vocab_size and bool((mapping == torch.arange(vocab_size)).all()):
        return None
    return mapping


def eagle3_settings(name: str, config: dict, state: dict, target) -> dict:
    """The [`PosSDraftConfig`] fields that make a one-specialist EAGLE-3 style draft of this checkpoint (its layer
    shape and rope are read like those of any official config.json)."""
    num_features = state["fc.weight"].shape[1] // config["hidden_size"]
    settings = dict(
        layer_style="eagle3",
        feature_layers=aux_layer_ids(name, config, target, num_features),
        own_lm_head="lm_head.weight" in state,
    )
    if target is not None:
        settings["target_num_hidden_layers"] = getattr(target.config.get_text_config(), "num_hidden_layers", None)
    return settings


def eagle3_state(state: dict) -> dict:
    """The checkpoint's tensors under this package's names (``embed_tokens.weight`` left to the caller)."""
    out = {f"layers.0.{key[len('midlayer.'):]}": value for key, value in state.items() if key.startswith("midlayer.")}
    out["feature_fc.weight"] = state["fc.weight"]
    out["norm.weight"] = state["norm.weight"]
    if "lm_head.weight" in state:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
