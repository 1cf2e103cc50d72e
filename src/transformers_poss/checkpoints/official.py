"""Import of the checkpoints released with the PosS paper, and of EAGLE / HASS and EAGLE-3 checkpoints.

Official layout: a Llama-style ``config.json`` (its ``num_hidden_layers`` is not the specialist count) and
``model.safetensors`` or ``pytorch_model.bin`` with flat keys ``embed_tokens.weight``, ``fc.weight``, optional
``fc.bias``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight`` and
``layers.{i}.post_attention_layernorm.weight``. N (positions per specialist) is not stored: it comes from the
argument or from ``PosS<N>`` in the repository name. EAGLE-3 checkpoints (a ``midlayer``) are read by
`official_eagle3`.
"""

from __future__ import annotations

import json
import os
import re

import torch
from transformers.utils import logging

from .configuration_poss import PosSDraftConfig
from .official_eagle3 import check_eagle3_layout, eagle3_settings, eagle3_state, is_eagle3_checkpoint, token_map

logger = logging.get_logger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(self_attn\.[qkvo]_proj\.weight|mlp\.(gate|up|down)_proj\.weight|post_attention_layernorm\.weight)$")
_POSS_NAME = re.compile(r"poss[-_]?(\d+)", re.IGNORECASE)


def resolve_folder(repo_id_or_folder: str, **hub_kwargs) -> str:
    """A local folder as is; a Hub id through huggingface_hub's normal (cached) download."""
    if os.path.isdir(repo_id_or_folder):
        return repo_id_or_folder
    from .checks import require_local_path

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


def load_official(cls, repo_id_or_folder: str, target=None, positions_per_specialist: int | None = None, dtype=None, **hub_kwargs):
    """Build a ``cls`` ([`PosSDraftModel`]) from an official checkpoint; attach ``target`` if given.

    S is the number of ``layers.{i}`` in the checkpoint. N comes from ``positions_per_specialist`` or from
    ``PosS<N>`` in the name; a multi-specialist checkpoint with neither is refused. A stored ``embed_tokens`` equal
    to the target's is dropped in favour of the target's; a different one is kept as the draft's own. An EAGLE-3
    checkpoint becomes a one-specialist ``layer_style="eagle3"`` draft (see `official_eagle3`).
    """
    if positions_per_specialist is not None:
        from .checks import positive_int

        positions_per_specialist = positive_int("positions_per_specialist", positions_per_specialist)
    folder = resolve_folder(repo_id_or_folder, **hub_kwargs)
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"No config.json in {folder}: not an official draft checkpoint.")
    llama_config = read_official_config(config_path)
    state = read_official_state_dict(folder)
    exported = llama_config.get("transformers_poss") if isinstance(llama_config.get("transformers_poss"), dict) else {}
    if positions_per_specialist is None and isinstance(exported.get("positions_per_specialist"), int):
        positions_per_specialist = exported["positions_per_specialist"]  # a `poss export` checkpoint records N
    token_ids = None
    if is_eagle3_checkpoint(state):
        check_eagle3_layout(repo_id_or_folder, llama_config, state)
        vocab = llama_config.get("vocab_size") or _eagle3_vocab(state)
        token_ids = token_map(repo_id_or_folder, state, vocab)
        settings = eagle3_settings(repo_id_or_folder, llama_config, state, target)
        settings.update(vocab_size=vocab, draft_vocab_size=None if token_ids is None else token_ids.numel())
        config = official_config(llama_config, state, 1, positions_per_specialist or 1, target=target, **settings)
        embed = state.get("embed_tokens.weight")
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
        config = official_config(llama_config, state, num_specialists, n, target=target,
                                 **({} if token_ids is None else {"draft_vocab_size": token_ids.numel()}))
        embed = state.pop("embed_tokens.weight", None)
    own = embed is not None and not _same_embedding(embed, target)
    if embed is not None and target is None:
        own = True
    config.own_embeddings = own
    if own:
        state["embed_tokens.weight"] = embed
    if dtype is None:
        dtype = target.dtype if target is not None else torch.float32
    model = cls(config)
    missing, unexpected = model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    missing = [k for k in missing if k != "draft_to_target"]
    if missing or unexpected:
        raise ValueError(f"Checkpoint does not fit the draft architecture: missing {missing}, unexpected {unexpected}.")
    if token_ids is not None:
        model.draft_to_target.copy_(token_ids)
    model = model.to(dtype)
    model.eval()
    restore_tree_settings(model, exported.get("generation"), repo_id_or_folder)
    if target is not None:
        device = target.get_output_embeddings().weight.device
        model.to(device).attach_target(target)
    return model


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


def restore_tree_settings(model, settings, name: str) -> None:
    """Put the tree shape an exported config recorded (``transformers_poss.generation``) back on the draft."""
    if not isinstance(settings, dict):
        return
    from .checks import TREE_KEYS, tree_value

    for key in TREE_KEYS:
        if settings.get(key) is not None:
            try:
                setattr(model.generation_config, key, tree_value(key, settings[key]))
            except ValueError as error:
                raise ValueError(f"{name}: config.json transformers_poss.generation: {error}") from None


def _eagle3_vocab(state: dict) -> int:
    """The target vocabulary of an EAGLE-3 checkpoint whose config.json does not give it."""
    for key in ("t2d", "embed_tokens.weight"):
        if key in state:
            return state[key].shape[0]
    raise ValueError("The EAGLE-3 checkpoint gives no vocab_size (config.json) and has no t2d / embed_tokens to read "
                     "it from; add vocab_size (the target's vocabulary) to its config.json.")
