"""Checks of a `poss train` run made before anything slow runs.

The schema ([`transformers_poss.training.config`]) types every value and refuses unknown settings; these checks add
what a type cannot say. `check_recipe` needs no model: numbers in range, the draft shape, that data, prompts and
``init_from`` exist (each prompts line parsed). `check_draft_fits` needs only the loaded target's config: it builds
the draft config the training stage will build, so a draft that cannot fit the target fails before data generation
and feature computation.
"""

from __future__ import annotations

import json
import os

from ..checks import finite_number, positive_int, require_file, require_local_path

_DATA_FILE_SUFFIXES = (".json", ".jsonl", ".gz")


def _optional_positive(name: str, value) -> None:
    if value is not None:
        positive_int(name, value)


def _data_source(name: str, source) -> None:
    """A data file must exist; a name that is not a path (a `datasets` name) is left to `datasets`."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"`{name}` entries must be file paths or dataset names, got {source!r}.")
    if source.endswith(_DATA_FILE_SUFFIXES):
        require_file(source, f"{name} file")
    else:
        require_local_path(source, f"{name} file")


def _prompts_file(path: str) -> None:
    """Every line of a prompts file is a JSON object with a non-empty ``prompt`` string."""
    from .distill import read_jsonl

    require_file(path, "--prompts file")
    for number, record in enumerate(read_jsonl(path), 1):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ValueError(f"{path}: record {number} needs a non-empty \"prompt\" string, got {record!r:.60}.")


def _init_from(draft) -> None:
    """``init_from`` must be a saved draft; a ``draft_vocab_size`` that differs from its kept map is refused now,
    not after the data and feature stages."""
    from ..checkpoints.loading import check_draft_folder

    require_local_path(draft.init_from, "--init_from draft folder")
    if not os.path.isdir(draft.init_from):
        return
    check_draft_folder(draft.init_from)
    with open(os.path.join(draft.init_from, "config.json"), encoding="utf-8") as handle:
        source = json.load(handle)
    source_vocab = source.get("draft_vocab_size")
    if source_vocab and draft.draft_vocab_size and draft.draft_vocab_size != source_vocab:
        raise ValueError(f"--draft_vocab_size {draft.draft_vocab_size} differs from the vocabulary of --init_from "
                         f"({source_vocab} tokens), which is kept: drop the setting or set it to the source's size.")
    source_style = source.get("layer_style", "eagle2")
    if source.get("model_type") == "poss_draft" and source_style != draft.layer_style:
        raise ValueError(f"--init_from {draft.init_from} has {source_style!r} layers; this draft has "
                         f"{draft.layer_style!r} layers: set --layer_style {source_style} or start from another draft.")
    source_layers, layers = source.get("feature_layers") or None, list(draft.feature_layers or []) or None
    if source_layers is not None and source_layers != layers:
        raise ValueError(f"--init_from {draft.init_from} reads feature_layers={source_layers}; this draft reads "
                         f"{layers if layers else 'the post-norm feature (feature_layers None)'}: set --feature_layers "
                         f"{' '.join(map(str, source_layers))}, or start from a single-feature (EAGLE-2) draft.")


def _feature_layers(layers) -> None:
    if not layers:
        return
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
        raise ValueError(f"--feature_layers must be indices >= 0 into the target's hidden states, got {layers}.")
    if len(set(layers)) != len(layers):
        raise ValueError(f"--feature_layers has a repeated layer: {layers}.")


def check_recipe(config) -> None:
    """Refuse a run (a [`PosSTrainConfig`]) that would fail, or silently do something else, later; no model loads."""
    script, draft, data = config.script, config.draft, config.data
    positive_int("--features_batch_size", script.features_batch_size)
    positive_int("--num_specialists", draft.num_specialists)
    positive_int("--positions_per_specialist", draft.positions_per_specialist)
    _optional_positive("--intermediate_size", draft.intermediate_size)
    _optional_positive("--draft_vocab_size", draft.draft_vocab_size)
    _feature_layers(draft.feature_layers)
    if draft.init_from:
        _init_from(draft)
    for source in data.train:
        _data_source("--train", source)
    for path in data.prompts:
        _prompts_file(path)
    if data.eval:
        _data_source("--eval", data.eval)
    if data.synthesize_prompts < 0:
        raise ValueError(f"`--synthesize_prompts` must be >= 0, got {data.synthesize_prompts}.")
    fraction = finite_number("--eval_fraction", data.eval_fraction, minimum=0.0)
    if fraction >= 1:
        raise ValueError(f"`--eval_fraction` must be below 1, got {fraction}.")
    _optional_positive("--max_conversations", data.max_conversations)
    for name in ("generation_batch_size", "generation_max_new_tokens", "prompt_batch_size", "prompt_max_new_tokens"):
        positive_int(f"--{name}", getattr(data, name))
    finite_number("--generation_temperature", data.generation_temperature, minimum=0.0)
    positive_int("--max_length", config.training.max_length)
    if not (data.train or data.prompts or data.synthesize_prompts) and script.stage != "train":
        raise ValueError("no training data: give --train, --prompts or --synthesize_prompts.")
    if script.stage not in ("data", "features"):  # those stages train nothing, so nothing resumes
        check_resumable(config)


# draft settings a run resumed from a checkpoint must share with it (None in the recipe: whatever the target gives)
_RESUMED_FIELDS = ("num_specialists", "positions_per_specialist", "layer_style", "feature_layers",
                   "intermediate_size", "draft_vocab_size")


def check_resumable(config) -> None:
    """A run into an ``output_dir`` that already holds checkpoints resumes from the newest complete one: refuse when
    that checkpoint's draft is not the one this recipe builds (other S, N, layers, widths or vocabulary), instead of
    silently keeping its weights or failing in the optimizer."""
    from .checkpoints import _CHECKPOINT, checkpoint_problem

    output_dir = config.training.output_dir
    if not output_dir or not os.path.isdir(output_dir):
        return
    found = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))),
                   reverse=True)
    for _, name in found:
        folder = os.path.join(output_dir, name)
        if checkpoint_problem(folder) is None:
            break
    else:
        return
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            stored = json.load(handle)
    except (OSError, ValueError):
        return  # not a draft checkpoint this check can read: the resume itself reports it
    draft, changed = config.draft, []
    for key in _RESUMED_FIELDS:
        wanted, had = getattr(draft, key), stored.get(key)
        if key == "feature_layers":
            wanted, had = list(wanted or []) or None, list(had or []) or None
        elif key == "layer_style":
            had = had or "eagle2"
        elif wanted is None:
            continue
        if wanted != had:
            changed.append(f"{key} {had!r} there, {wanted!r} now")
    if changed:
        raise ValueError(
            f"--output_dir {output_dir} holds {name} of another draft ({'; '.join(changed)}): training would resume "
            "from it and keep its weights. Give a new --output_dir, or move its checkpoint-* folders away to start "
            "fresh."
        )


def draft_shape_fields(draft) -> dict:
    """The `PosSDraftConfig.for_target` keywords of a [`PosSDraftArguments`] beyond S, N and the MLP width."""
    out = {"layer_style": draft.layer_style}
    if draft.feature_layers:
        out["feature_layers"] = list(draft.feature_layers)
    return out


def check_draft_fits(config, target) -> None:
    """Build the draft config for ``target`` as the training stage will (before data and features are made)."""
    from ..configuration_poss import PosSDraftConfig

    draft = config.draft
    extra = draft_shape_fields(draft)
    try:
        PosSDraftConfig.for_target(target.config, num_specialists=draft.num_specialists,
                                   positions_per_specialist=draft.positions_per_specialist,
                                   intermediate_size=draft.intermediate_size, draft_vocab_size=draft.draft_vocab_size,
                                   **extra)
    except ValueError as error:
        raise ValueError(f"the draft does not fit the target {config.script.target}: {error}") from None
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    count = getattr(text, "num_hidden_layers", None)
    if draft.feature_layers and count is not None and max(draft.feature_layers) > count:
        raise ValueError(f"--feature_layers {list(draft.feature_layers)}: the target {config.script.target} has "
                         f"{count} layers, so its hidden states are 0..{count} ({count} = the post-norm feature).")
