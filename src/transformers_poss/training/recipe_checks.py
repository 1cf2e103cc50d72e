"""Checks of a `poss train` recipe made before anything slow runs.

`check_recipe` needs no model: the stage names, numbers, draft shape, data files (each prompts line parsed) and the
training arguments. `check_draft_fits` needs only the loaded target's config: it builds the draft config the training
stage will build, so a draft shape that cannot fit the target fails before data generation and feature computation.
"""

from __future__ import annotations

import dataclasses
import difflib
import os

from ..checks import finite_number, positive_int, require_file, require_local_path

STAGES = ("data", "features", "train", "all")
FEATURE_MODES = ("offline", "online")
_DATA_FILE_SUFFIXES = (".json", ".jsonl", ".gz")


def _optional_positive(name: str, value) -> None:
    if value is not None:
        positive_int(name, value)


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(choices)}, got {value!r}.")


def _data_source(name: str, source) -> None:
    """A data file must exist; a name that is not a path (a `datasets` name) is left to `datasets`."""
    if not isinstance(source, str):
        raise ValueError(f"`{name}` entries must be file paths or dataset names, got {source!r}.")
    if source.endswith(_DATA_FILE_SUFFIXES):
        require_file(source, f"{name} file")
    else:
        require_local_path(source, f"{name} file")


def _prompts_file(path: str) -> None:
    """Every line of a prompts file is a JSON object with a non-empty ``prompt`` string."""
    from .distill import read_jsonl

    require_file(path, "data.prompts file")
    for number, record in enumerate(read_jsonl(path), 1):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ValueError(f"{path}: record {number} needs a non-empty \"prompt\" string, got {record!r:.60}.")


def _training_arguments(config: dict) -> None:
    from .trainer import PosSTrainingArguments

    training = dict(config["training"] or {})
    known = {f.name for f in dataclasses.fields(PosSTrainingArguments)}
    for key in training:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise ValueError(f"`training.{key}` is not a training argument"
                             + (f"; did you mean `training.{close[0]}`?" if close else "."))
        if key in ("output_dir", "seed", "max_length"):
            raise ValueError(f"`training.{key}` is set from the recipe's top level (`{key}` / data.max_length); "
                             "remove it from `training`.")
    try:
        PosSTrainingArguments(output_dir=config["output_dir"], seed=config["seed"],
                              max_length=config["data"]["max_length"], **training)
    except (TypeError, ValueError) as error:
        raise ValueError(f"`training`: {error}") from None


def check_recipe(config: dict) -> None:
    """Refuse a recipe that would fail (or silently do something else) later; no model is loaded."""
    _choice("stage", config["stage"], STAGES)
    _choice("features", config["features"], FEATURE_MODES)
    import torch

    dtype = getattr(torch, str(config["features_dtype"]), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"`features_dtype` must be a floating dtype (bfloat16, float16, float32), got "
                         f"{config['features_dtype']!r}.")
    positive_int("features_batch_size", config["features_batch_size"])
    if isinstance(config["seed"], bool) or not isinstance(config["seed"], int):
        raise ValueError(f"`seed` must be an integer, got {config['seed']!r}.")
    draft = config["draft"]
    positive_int("draft.num_specialists", draft["num_specialists"])
    positive_int("draft.positions_per_specialist", draft["positions_per_specialist"])
    _optional_positive("draft.intermediate_size", draft.get("intermediate_size"))
    _optional_positive("draft.draft_vocab_size", draft.get("draft_vocab_size"))
    if draft.get("init_from"):
        require_local_path(draft["init_from"], "draft.init_from folder")
    data = config["data"]
    for source in data["train"]:
        _data_source("data.train", source)
    for path in data["prompts"]:
        _prompts_file(path)
    if data.get("eval"):
        _data_source("data.eval", data["eval"])
    positive_int("data.max_length", data["max_length"])
    if isinstance(data["synthesize_prompts"], bool) or not isinstance(data["synthesize_prompts"], int) \
            or data["synthesize_prompts"] < 0:
        raise ValueError(f"`data.synthesize_prompts` must be an integer >= 0, got {data['synthesize_prompts']!r}.")
    fraction = finite_number("data.eval_fraction", data["eval_fraction"], minimum=0.0)
    if fraction >= 1:
        raise ValueError(f"`data.eval_fraction` must be below 1, got {fraction}.")
    generation = data["generation"]
    for key in ("batch_size", "max_new_tokens", "prompt_batch_size", "prompt_max_new_tokens"):
        positive_int(f"data.generation.{key}", generation[key])
    finite_number("data.generation.temperature", generation["temperature"], minimum=0.0)
    if not (data["train"] or data["prompts"] or data["synthesize_prompts"]) and config["stage"] != "train":
        raise ValueError("no training data: give data.train, data.prompts or data.synthesize_prompts.")
    _training_arguments(config)


def check_draft_fits(config: dict, target) -> None:
    """Build the draft config for ``target`` as the training stage will (before data and features are made)."""
    from ..configuration_poss import PosSDraftConfig

    spec = config["draft"]
    try:
        PosSDraftConfig.for_target(target.config, num_specialists=spec["num_specialists"],
                                   positions_per_specialist=spec["positions_per_specialist"],
                                   intermediate_size=spec.get("intermediate_size"),
                                   draft_vocab_size=spec.get("draft_vocab_size"))
    except ValueError as error:
        raise ValueError(f"`draft` does not fit the target {config['target']}: {error}") from None
