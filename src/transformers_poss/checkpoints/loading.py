"""Loading a saved PosS draft (`load_pretrained`, behind ``PosSDraftModel.from_pretrained``): the folder is checked
before transformers reads it and the model after, then the files saved beside the weights are read back (the tree
shape in ``generation_config.json``, the model card, ``training_recipe.json``).

A folder that is not a PosS draft (a target model, an authors' PosS / EAGLE / HASS checkpoint, a hand-edited or
truncated save) is refused with a message that names the folder and says what to do, instead of loading as a draft
with random weights.
"""

from __future__ import annotations

import json
import os
import re

from transformers import GenerationConfig

from ..checks import require_local_path, tree_value
from ..configuration_poss import TREE_GENERATION_KEYS
from .model_card import CARD_FILE, RECIPE_FILE, split_card

__all__ = [
    "MODEL_TYPE", "check_draft_folder", "check_draft_source", "check_loaded_draft", "check_token_map",
    "checked_from_pretrained", "load_hub_files", "load_pretrained", "load_tree_generation_config", "safetensors_keys",
]

MODEL_TYPE = "poss_draft"
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
_LAYER = re.compile(r"^(?:[a-z_]+\.)?layers\.(\d+)\.")
_OFFICIAL_HINT = (
    "load it with PosSDraftModel.from_official(path, target=target) (or convert it once with "
    "`poss convert PATH --target TARGET --output FOLDER`)"
)


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no config.json: it is not a saved PosS draft (save one with "
                                "draft.save_pretrained(folder)).")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); restore the file or save the draft again.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object; restore the file or save the draft again.")
    return config


def safetensors_keys(path: str) -> list[str]:
    """Tensor names of a safetensors file (header only); a truncated or foreign file raises a ValueError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            keys = list(handle.keys())
    except Exception as error:  # safetensors raises its own error types
        raise ValueError(
            f"{path} is not a readable safetensors file ({error}): it is truncated or not a model file; "
            "download or save it again."
        ) from None
    size = os.path.getsize(path)
    with open(path, "rb") as handle:  # the header tells where the data ends: a file cut inside the data is refused
        header_length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_length))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_length + end > size:
        raise ValueError(f"{path} is truncated ({size} bytes, its header describes {8 + header_length + end}); "
                         "download or save it again.")
    return keys


def _weight_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def _layer_count(keys) -> int | None:
    indices = {int(m.group(1)) for m in map(_LAYER.match, keys) if m}
    return max(indices) + 1 if indices else None


def check_draft_source(source: str) -> None:
    """Check a draft given by path or Hub id where official checkpoints are accepted too (``poss bench --draft``):
    a missing local path or a folder that is neither a PosS draft nor an authors' checkpoint is refused."""
    require_local_path(source, "draft folder")
    if os.path.isdir(source):
        check_draft_folder(source, allow_official=True)


def check_draft_folder(folder: str, allow_official: bool = False) -> None:
    """Refuse a local folder that cannot be a readable PosS draft, before transformers loads it.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: not a PosS draft (a target, an authors' checkpoint), config keys missing, unreadable weights,
            or a config whose ``num_specialists`` disagrees with the stored layers.
    """
    config = _read_config(folder)
    files = _weight_files(folder)
    keys = [k for path in files for k in safetensors_keys(path)]
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        official = "fc.weight" in keys
        found = f"model_type {model_type!r}" if model_type else "no model_type"
        if official or (not keys and os.path.isfile(os.path.join(folder, "pytorch_model.bin"))):
            if allow_official:
                return
            raise ValueError(
                f"{folder} is not a PosS draft saved by this library ({found}); if it is a checkpoint released with "
                f"the PosS paper or an EAGLE / HASS / EAGLE-3 one, {_OFFICIAL_HINT}."
            )
        raise ValueError(
            f"{folder} is not a PosS draft ({found} in its config.json; a draft has model_type {MODEL_TYPE!r}). "
            "It looks like a target model: pass it as the target and give a draft folder as the draft."
        )
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"{os.path.join(folder, 'config.json')} lacks {', '.join(missing)}: restore the file or "
                         "save the draft again (draft.save_pretrained).")
    for key, value in config.items():  # a number written as a string ("64"): name the file, the field and the fix
        if isinstance(value, str) and value.strip().lstrip("-").replace(".", "", 1).isdigit() and (
                key.endswith(("_size", "_id", "_eps", "_theta")) or key.startswith(("num_", "tree_"))
                or key in ("head_dim", "positions_per_specialist", "max_position_embeddings")):
            raise ValueError(f"{os.path.join(folder, 'config.json')}: `{key}` is the string {value!r}; write it as a "
                             f"number ({value.strip()}, without quotes).")
    stored = _layer_count(keys)
    wanted = config.get("num_specialists", 1)
    if stored is not None and stored != wanted:
        raise ValueError(
            f"{os.path.join(folder, 'config.json')} says num_specialists={wanted} but the weights hold {stored} "
            f"specialist layers: set num_specialists back to {stored} (a trained draft's layer count cannot be "
            "changed by editing its config)."
        )


def check_loaded_draft(name: str, loading_info: dict) -> None:
    """Refuse a draft whose checkpoint did not provide every weight (or provided foreign ones)."""
    missing = sorted(loading_info.get("missing_keys") or [])
    unexpected = sorted(loading_info.get("unexpected_keys") or [])
    mismatched = loading_info.get("mismatched_keys") or []
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} weights missing ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:4])}"
                         f"{', ...' if len(unexpected) > 4 else ''})")
        if mismatched:
            parts.append(f"{len(mismatched)} of the wrong shape")
        raise ValueError(
            f"{name} does not hold the weights of a PosS draft: {'; '.join(parts)}. It is not a draft saved with "
            f"save_pretrained (for an authors' PosS / EAGLE / HASS checkpoint, {_OFFICIAL_HINT})."
        )


def check_token_map(draft) -> None:
    """A stored token map must hold ``draft_vocab_size`` distinct ids inside the vocabulary."""
    import torch

    token_map = getattr(draft, "draft_to_target", None)
    if token_map is None:
        return
    vocab = draft.config.vocab_size
    problems = []
    if token_map.dim() != 1 or token_map.numel() != draft.config.draft_vocab_size:
        problems.append(f"it holds {token_map.numel()} ids but draft_vocab_size is {draft.config.draft_vocab_size}")
    elif token_map.numel():
        low, high = int(token_map.min()), int(token_map.max())
        if low < 0 or high >= vocab:
            problems.append(f"its ids span {low}..{high}, outside the vocabulary [0, {vocab})")
        if torch.unique(token_map).numel() != token_map.numel():
            problems.append("it holds duplicate ids")
    if problems:
        raise ValueError(
            "The draft's token map (draft_to_target) is invalid: " + "; ".join(problems)
            + ". Rebuild it with `poss vocab` or transformers_poss.vocab.set_token_map."
        )


def checked_from_pretrained(load, name, *args, **kwargs):
    """``load(name, ...)`` (``PreTrainedModel.from_pretrained``) with the checks of this module around it.

    Returns ``(model, loading_info)``.
    """
    if isinstance(name, (str, os.PathLike)):
        require_local_path(name, "draft folder")
        if os.path.isdir(name):
            check_draft_folder(str(name))
    kwargs["output_loading_info"] = True
    try:
        model, info = load(name, *args, **kwargs)
    except OSError as error:
        if isinstance(name, (str, os.PathLike)) and not os.path.exists(name):
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise OSError(f"{name}: there is no such local folder, and loading it as a Hub id failed: {first}") from error
        raise
    except Exception as error:
        if type(error).__name__ == "SafetensorError":
            raise ValueError(f"The weights of {name} are not a readable safetensors file ({error}); download or "
                             "save the draft again.") from error
        raise
    check_loaded_draft(str(name), info)
    check_token_map(model)
    return model, info


# ---------------------------------------------------------------------------------------------------- saved files
def load_tree_generation_config(name_or_path, config, kwargs) -> GenerationConfig:
    """The saved generation config (tree shape) if there is one, else the tree defaults of ``config``."""
    try:
        loaded = GenerationConfig.from_pretrained(name_or_path, **_hub_kwargs(kwargs))
    except (OSError, ValueError):
        loaded = GenerationConfig()
    for key in TREE_GENERATION_KEYS:
        if getattr(loaded, key, None) is None:
            setattr(loaded, key, getattr(config, key))
        try:
            setattr(loaded, key, tree_value(key, getattr(loaded, key)))
        except ValueError as error:
            raise ValueError(f"generation_config.json of {name_or_path}: {error} Fix the file or set "
                             f"draft.generation_config.{key} after loading.") from None
    return loaded


def _hub_kwargs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in ("cache_dir", "local_files_only", "token", "revision") if k in kwargs}


def _optional_file(name_or_path, filename: str, kwargs: dict) -> str | None:
    """A file of a draft folder or Hub repo that may lack it: its local path, or None (also when the Hub cannot be
    reached: the card and the recipe are optional)."""
    if os.path.isdir(str(name_or_path)):
        path = os.path.join(str(name_or_path), filename)
        return path if os.path.isfile(path) else None
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(str(name_or_path), filename, **_hub_kwargs(kwargs))
    except Exception:  # noqa: BLE001 - no such file or repo, offline, ...: the file is optional
        return None


def load_hub_files(model, name_or_path, kwargs: dict) -> None:
    """Read the card (its metadata and hand-written part) and ``training_recipe.json`` of a draft folder or repo."""
    recipe_path = _optional_file(name_or_path, RECIPE_FILE, kwargs)
    card_path = _optional_file(name_or_path, CARD_FILE, kwargs)
    if recipe_path:
        try:
            with open(recipe_path, encoding="utf-8") as handle:
                model.training_recipe = json.load(handle)
        except (OSError, ValueError):
            model.training_recipe = None
    if card_path:
        with open(card_path, encoding="utf-8") as handle:
            metadata, extra = split_card(handle.read())
        object.__setattr__(model, "_poss_card_metadata", metadata)
        if extra and not getattr(model, "model_card_extra", None):
            model.model_card_extra = extra


def load_pretrained(load, name, args: tuple, kwargs: dict):
    """``PosSDraftModel.from_pretrained``: ``load`` (transformers' ``from_pretrained``) with the checks of this module
    around it, then the files saved beside the weights: the tree shape (``generation_config.json``), the card and
    ``training_recipe.json``. Returns the model, or ``(model, loading_info)`` with ``output_loading_info=True``."""
    model, info = checked_from_pretrained(load, name, *args, **kwargs)
    model.generation_config = load_tree_generation_config(name, model.config, kwargs)
    load_hub_files(model, name, kwargs)
    return (model, info) if kwargs.get("output_loading_info") else model
