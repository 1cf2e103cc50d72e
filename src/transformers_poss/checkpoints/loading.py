"""Checks around loading a saved PosS draft: the folder before ``from_pretrained`` reads it, the model after.

A folder that is not a PosS draft (a target model, an authors' PosS / EAGLE / HASS checkpoint, a hand-edited or
truncated save) is refused with a message that names the folder and says what to do, instead of loading as a draft
with random weights.
"""

from __future__ import annotations

import json
import os
import re

MODEL_TYPE = "poss_draft"
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
_LAYER = re.compile(r"^(?:[a-z_]+\.)?layers\.(\d+)\.")
_OFFICIAL_HINT = (
    "load it with PosSDraftModel.from_official(path, target=target) (or convert it once with "
    "`poss convert PATH OUTPUT --target TARGET`)"
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
    from .checks import require_local_path

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
    from .checks import require_local_path

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
