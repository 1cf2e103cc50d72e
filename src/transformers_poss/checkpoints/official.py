"""Import of the checkpoints released with the PosS paper, and of EAGLE / HASS and EAGLE-3 checkpoints.

Official layout: a Llama-style ``config.json`` (its ``num_hidden_layers`` is not the specialist count) and
``model.safetensors`` or ``pytorch_model.bin`` with flat keys ``embed_tokens.weight``, ``fc.weight``, optional
``fc.bias``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight`` and
``layers.{i}.post_attention_layernorm.weight``. N (positions per specialist) is not stored: it comes from the
argument or from ``PosS<N>`` in the repository name.

EAGLE-3 checkpoints (SafeAILab/EAGLE, SpecForge; the layout vLLM and SGLang load as ``eagle3``; the second half of
this module) have a Llama-style ``config.json`` (``draft_vocab_size``, optionally ``target_hidden_size``, the target
layers in ``eagle_aux_hidden_state_layer_ids`` or ``eagle_config.eagle_aux_hidden_state_layer_ids``, else EAGLE-3's
default ``[2, L // 2, L - 3]`` of the target's L layers) and flat keys ``midlayer.*`` (one decoder layer whose
q/k/v take ``2H`` inputs, plus ``hidden_norm``), ``fc.weight`` `[H, k*H]`, ``norm.weight``, ``lm_head.weight``
`[draft_vocab, H]`, ``d2t`` `[draft_vocab]` offsets (target id = draft id + ``d2t[draft id]``), ``t2d`` `[vocab]`
bool, sometimes ``embed_tokens.weight``. They map onto a one-specialist ``layer_style="eagle3"`` draft:
``midlayer.*`` -> ``layers.0.*``, ``fc`` -> ``feature_fc``, ``norm``, ``lm_head`` (``own_lm_head=True``),
``feature_layers`` = the aux layer ids (both count the hidden state entering decoder layer i as i),
``draft_to_target`` = ``arange + d2t``. What the format cannot represent is refused: a draft hidden size other than
the target's, attention / MLP biases, ``norm_before_residual``, no aux hidden states, more than one midlayer,
unexpected keys.

`read_official` turns a checkpoint into an `OfficialCheckpoint` (config, state dict, token map, tree shape);
``PosSDraftModel.from_official`` builds the draft from it. Checks of user values (`checks`) are made first, the
config (`configuration_poss`) is built last, so a load goes down through this module once.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from ..checks import TREE_KEYS, positive_int, require_local_path, tree_value
from ..configuration_poss import PosSDraftConfig, eagle3_feature_layers

logger = logging.get_logger(__name__)

__all__ = [
    "OfficialCheckpoint", "read_official", "load_official", "resolve_folder", "read_official_config",
    "read_official_state_dict", "official_config", "positions_from_name", "exported_token_map", "tree_settings",
    "is_eagle3_checkpoint", "check_eagle3_layout", "aux_layer_ids", "token_map", "eagle3_settings", "eagle3_state",
]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(self_attn\.[qkvo]_proj\.weight|mlp\.(gate|up|down)_proj\.weight|post_attention_layernorm\.weight)$")
_POSS_NAME = re.compile(r"poss[-_]?(\d+)", re.IGNORECASE)


def resolve_folder(repo_id_or_folder: str, **hub_kwargs) -> str:
    """A local folder as is; a Hub id through huggingface_hub's normal (cached) download."""
    if os.path.isdir(repo_id_or_folder):
        return repo_id_or_folder
    require_local_path(repo_id_or_folder, "checkpoint folder")
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id_or_folder, allow_patterns=["config.json", *WEIGHT_FILES], **hub_kwargs
    )


def read_official_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """Read the flat official state dict: safetensors preferred; a .bin only through ``weights_only=True``."""
    path_st = os.path.join(folder, WEIGHT_FILES[0])
    path_bin = os.path.join(folder, WEIGHT_FILES[1])
    if os.path.exists(path_st):
        from safetensors.torch import load_file

        try:
            return load_file(path_st)
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{path_st} is not a readable safetensors file ({err}); download it again.") from err
    if os.path.exists(path_bin):
        try:
            state = torch.load(path_bin, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(
                f"{path_bin} could not be read as plain tensors ({type(err).__name__}: {err}). Only weights are "
                "loaded (no pickled code); convert the checkpoint to safetensors with a trusted tool first."
            ) from err
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{path_bin} does not hold a flat state dict of tensors.")
        return state
    raise FileNotFoundError(f"No {' or '.join(WEIGHT_FILES)} in {folder}.")


def read_official_config(path: str) -> dict:
    """The Llama-style config.json of an official checkpoint, with the keys the draft needs."""
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); download the checkpoint again.") from None
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads") if k not in config]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: not the config of a PosS / EAGLE / HASS checkpoint.")
    return config


def positions_from_name(name: str) -> int | None:
    """N from a ``PosS<N>`` / ``PosS-<N>`` in a repository name or folder name, else None."""
    match = _POSS_NAME.search(os.path.basename(os.path.normpath(name)) or name)
    return int(match.group(1)) if match else None


def _count_specialists(state: dict) -> int:
    indices = set()
    unexpected = []
    for key in state:
        match = _LAYER_KEY.match(key)
        if match:
            indices.add(int(match.group(1)))
        elif key not in ("embed_tokens.weight", "fc.weight", "fc.bias"):
            unexpected.append(key)
    if unexpected:
        raise ValueError(f"Not an official PosS/EAGLE/HASS draft checkpoint: unexpected keys {sorted(unexpected)[:8]}.")
    if not indices or sorted(indices) != list(range(len(indices))):
        raise ValueError(f"Checkpoint layers must be numbered 0..S-1, found {sorted(indices)}.")
    return len(indices)


def official_config(
    llama_config: dict, state: dict, num_specialists: int, positions_per_specialist: int, target=None, **settings
) -> PosSDraftConfig:
    """A [`PosSDraftConfig`] from the official Llama-style config.json and the state dict (``settings``: more
    config fields)."""
    rope = {"rope_type": "default", "rope_theta": float(llama_config.get("rope_theta", 10000.0))}
    scaling = llama_config.get("rope_scaling") or llama_config.get("rope_parameters")
    if isinstance(scaling, dict):
        rope.update({k: v for k, v in scaling.items() if k != "type"})
        rope["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    hidden = llama_config["hidden_size"]
    fingerprint = {}
    if target is not None:
        text = target.config.get_text_config()
        fingerprint = dict(
            target_model_type=text.model_type,
            target_name_or_path=getattr(target.config, "_name_or_path", None) or None,
            target_vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
        )
    return PosSDraftConfig(
        vocab_size=settings.pop("vocab_size", None) or llama_config.get(
            "vocab_size", state["embed_tokens.weight"].shape[0] if "embed_tokens.weight" in state else None
        ),
        hidden_size=hidden,
        intermediate_size=llama_config["intermediate_size"],
        num_attention_heads=llama_config["num_attention_heads"],
        num_key_value_heads=llama_config.get("num_key_value_heads"),
        head_dim=llama_config.get("head_dim"),
        rms_norm_eps=llama_config.get("rms_norm_eps", 1e-6),
        rope_parameters=rope,
        max_position_embeddings=llama_config.get("max_position_embeddings", 8192),
        num_specialists=num_specialists,
        positions_per_specialist=positions_per_specialist,
        fc_bias="fc.bias" in state,
        **fingerprint,
        **settings,
    )


def _same_embedding(draft_embed: torch.Tensor, target) -> bool:
    if target is None:
        return False
    weight = target.get_input_embeddings().weight
    if weight.shape != draft_embed.shape:
        return False
    return torch.allclose(draft_embed.to(weight.device, torch.float32), weight.detach().float(), atol=1e-3, rtol=1e-3)


@dataclass
class OfficialCheckpoint:
    """An authors' / EAGLE / HASS / EAGLE-3 checkpoint read and mapped onto this package's draft: what
    ``PosSDraftModel.from_official`` builds the draft from."""

    config: PosSDraftConfig
    state_dict: dict[str, torch.Tensor]  # float32, under this package's names
    token_map: torch.LongTensor | None = None  # ``draft_to_target``, when the drafting vocabulary is reduced
    generation: dict = field(default_factory=dict)  # checked tree settings an exported checkpoint recorded


def read_official(repo_id_or_folder: str, target=None, positions_per_specialist: int | None = None, **hub_kwargs
                  ) -> OfficialCheckpoint:
    """Read an official checkpoint (folder or Hub id) as an `OfficialCheckpoint`.

    S is the number of ``layers.{i}`` in the checkpoint. N comes from ``positions_per_specialist`` or from
    ``PosS<N>`` in the name; a multi-specialist checkpoint with neither is refused. A stored ``embed_tokens`` equal
    to ``target``'s is dropped in favour of the target's; a different one is kept as the draft's own. An EAGLE-3
    checkpoint becomes a one-specialist ``layer_style="eagle3"`` draft.
    """
    if positions_per_specialist is not None:
        positions_per_specialist = positive_int("positions_per_specialist", positions_per_specialist)
    folder = resolve_folder(repo_id_or_folder, **hub_kwargs)
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"No config.json in {folder}: not an official draft checkpoint.")
    llama_config = read_official_config(config_path)
    exported = llama_config.get("transformers_poss") if isinstance(llama_config.get("transformers_poss"), dict) else {}
    generation = tree_settings(exported.get("generation"), repo_id_or_folder)
    state = read_official_state_dict(folder)
    if positions_per_specialist is None and isinstance(exported.get("positions_per_specialist"), int):
        positions_per_specialist = exported["positions_per_specialist"]  # a `poss export` checkpoint records N
    if is_eagle3_checkpoint(state):
        check_eagle3_layout(repo_id_or_folder, llama_config, state)
        vocab = llama_config.get("vocab_size") or _eagle3_vocab(state)
        token_ids = token_map(repo_id_or_folder, state, vocab)
        embed = state.get("embed_tokens.weight")
        settings = dict(vocab_size=vocab, draft_vocab_size=None if token_ids is None else token_ids.numel(),
                        **eagle3_settings(repo_id_or_folder, llama_config, state, target))
        num_specialists, n = 1, positions_per_specialist or 1
        state = eagle3_state(state)
    else:
        num_specialists = _count_specialists(state)
        n = positions_per_specialist or positions_from_name(repo_id_or_folder)
        if n is None:
            if num_specialists > 1:
                raise ValueError(
                    f"{repo_id_or_folder} has {num_specialists} specialist layers but N (positions per specialist) "
                    "is not stored in the checkpoint and its name has no 'PosS<N>': pass positions_per_specialist=N "
                    "(e.g. 2 for a PosS-2 checkpoint)."
                )
            n = 1
        token_ids = exported_token_map(folder, exported, llama_config.get("vocab_size"))
        settings = {} if token_ids is None else {"draft_vocab_size": token_ids.numel()}
        embed = state.pop("embed_tokens.weight", None)
    own = embed is not None and (target is None or not _same_embedding(embed, target))
    if own:
        state["embed_tokens.weight"] = embed
    config = official_config(llama_config, state, num_specialists, n, target=target, own_embeddings=own, **settings)
    state = {k: v.to(torch.float32) for k, v in state.items()}
    return OfficialCheckpoint(config=config, state_dict=state, token_map=token_ids, generation=generation)


def load_official(cls, repo_id_or_folder: str, target=None, positions_per_specialist: int | None = None, **kwargs):
    """``cls.from_official(...)`` (kept for callers of the function form)."""
    return cls.from_official(repo_id_or_folder, target=target, positions_per_specialist=positions_per_specialist,
                             **kwargs)


def exported_token_map(folder: str, exported: dict, vocab_size) -> torch.LongTensor | None:
    """The reduced drafting vocabulary a `poss export --format eagle` checkpoint keeps beside its weights
    (``hot_token_ids.pt``, recorded in its config's ``transformers_poss.draft_vocab_size``), or None."""
    size = exported.get("draft_vocab_size")
    path = os.path.join(folder, "hot_token_ids.pt")
    if not size:
        return None
    if not os.path.isfile(path):
        logger.warning("%s: config.json records a %s-token drafting vocabulary but hot_token_ids.pt is missing; the "
                       "converted draft drafts over the full vocabulary.", folder, size)
        return None
    token_ids = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.numel() != size:
        raise ValueError(f"{path}: expected a 1D tensor of {size} token ids (config.json's "
                         "transformers_poss.draft_vocab_size); export the draft again.")
    token_ids = token_ids.long()
    if vocab_size and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(f"{path}: token ids outside the vocabulary of {vocab_size}; export the draft again.")
    return token_ids


def tree_settings(settings, name: str) -> dict:
    """The tree shape an exported config recorded (``transformers_poss.generation``), checked; {} when none."""
    if not isinstance(settings, dict):
        return {}
    checked = {}
    for key in TREE_KEYS:
        if settings.get(key) is not None:
            try:
                checked[key] = tree_value(key, settings[key])
            except ValueError as error:
                raise ValueError(f"{name}: config.json transformers_poss.generation: {error}") from None
    return checked


def _eagle3_vocab(state: dict) -> int:
    """The target vocabulary of an EAGLE-3 checkpoint whose config.json does not give it."""
    for key in ("t2d", "embed_tokens.weight"):
        if key in state:
            return state[key].shape[0]
    raise ValueError("The EAGLE-3 checkpoint gives no vocab_size (config.json) and has no t2d / embed_tokens to read "
                     "it from; add vocab_size (the target's vocabulary) to its config.json.")


# ---------------------------------------------------------------------------------------------------- EAGLE-3
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
