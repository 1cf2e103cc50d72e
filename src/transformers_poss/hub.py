"""Hub plumbing of PosS drafts: the model card, uploads, and the files that travel with a draft.

A saved draft folder holds ``model.safetensors``, ``config.json``, ``generation_config.json`` (the tree shape),
``README.md`` (the draft's own card, built with huggingface_hub's `ModelCard` / `ModelCardData`) and, when the draft
carries one, ``training_recipe.json``. Loading a folder or Hub repo reads the card and the recipe back, so a hand
written part of the card (``model.model_card_extra``) and the recipe survive load -> save -> push.

Uploads go through huggingface_hub's public API (`HfApi.create_repo`, `HfApi.upload_folder`), for
``draft.push_to_hub(...)``, ``draft.save_pretrained(path, push_to_hub=True)`` and the Trainer's ``push_to_hub``
(whose generic card is replaced by the draft's own, see `install_trainer_card_hook`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from transformers import GenerationConfig

CARD_TAGS = ["transformers-poss", "speculative-decoding", "poss", "draft-model"]
LIBRARY_NAME = "transformers-poss"
PIPELINE_TAG = "text-generation"
RECIPE_FILE = "training_recipe.json"
CARD_FILE = "README.md"
GENERATED_START = "<!-- transformers-poss: generated section, rewritten on every save -->"
GENERATED_END = "<!-- transformers-poss: end of generated section; text below is kept -->"
# cards written before the markers existed end their generated part with this usage block
_LEGACY_END = "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=256)\n```\n"
# embedded target names (transformers_poss.embedded) -> the Hub repository they were converted from
EMBEDDED_HUB_IDS = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma3-270m": "google/gemma-3-270m",
}
# metadata regenerated on every save; any other key of a loaded card (license, datasets, language, ...) is kept
_GENERATED_KEYS = {"library_name", "pipeline_tag", "base_model", "tags", "model-index", "eval_results", "model_name"}

__all__ = [
    "build_model_card", "render_model_card", "write_model_card", "card_metrics", "push_draft_to_hub",
    "save_draft_files", "load_hub_files", "install_trainer_card_hook", "load_tree_generation_config",
]


# ---------------------------------------------------------------------------------------------------- the card
def base_model_id(target: str | None) -> str | None:
    """The Hub id of the target for the card's ``base_model``: a Hub id as is, an embedded name mapped to the repo
    it comes from; None for a local folder or an unknown name."""
    if not target:
        return None
    if target in EMBEDDED_HUB_IDS:
        return EMBEDDED_HUB_IDS[target]
    if os.path.isabs(target) or os.path.exists(target) or target.count("/") != 1 or target.startswith("."):
        return None
    return target


def card_metrics(model, extra: dict | None = None) -> dict[str, float]:
    """Measured figures for the card's eval results: the ``eval`` block of ``model.training_recipe``, then
    ``model.model_card_metrics`` (a dict set by the user, e.g. benchmark figures), then ``extra``; numbers only."""
    metrics: dict[str, float] = {}
    recipe = getattr(model, "training_recipe", None)
    sources = [recipe.get("eval") if isinstance(recipe, dict) else None,
               getattr(model, "model_card_metrics", None), extra]
    for source in sources:
        for key, value in (source or {}).items():
            if key in ("epoch", "step") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metrics[str(key)] = float(value)
    return metrics


def _eval_results(metrics: dict[str, float], recipe) -> list:
    from huggingface_hub import EvalResult

    data = (recipe.get("config") or {}).get("data") or {} if isinstance(recipe, dict) else {}
    source = data.get("eval") or data.get("train") if isinstance(data, dict) else None
    source = source[0] if isinstance(source, list) and source else source
    dataset_type = source if isinstance(source, str) and base_model_id(source) else "held-out-conversations"
    return [
        EvalResult(task_type="text-generation", task_name="speculative drafting", dataset_type=dataset_type,
                   dataset_name="held-out conversations", dataset_split="held-out", metric_type=name,
                   metric_name=name, metric_value=value)
        for name, value in metrics.items()
    ]


def _generated_body(model, repo: str) -> str:
    config, gen = model.config, model.generation_config
    target = config.target_name_or_path or "unknown"
    if config.draft_vocab_size:
        vocab = f"{config.draft_vocab_size} of {config.vocab_size} tokens"
    else:
        vocab = f"full ({config.vocab_size})"
    if config.num_specialists > 1:
        title = f"PosS-{config.positions_per_specialist} draft for {target}"
    else:
        title = f"Draft (S = 1) for {target}"
    rows = [
        ("target model", target),
        ("target model type", config.target_model_type or "unknown"),
        ("specialists (S)", config.num_specialists),
        ("positions per specialist (N)", config.positions_per_specialist),
        ("training depth (S x N)", config.training_depth),
        ("draft vocabulary", vocab),
        ("default tree (depth / top-k / total tokens)",
         f"{gen.tree_depth} / {gen.tree_top_k} / {gen.tree_total_tokens}"),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return f"""{GENERATED_START}
# {title}

A PosS (Position Specialists) draft model for tree speculative decoding with
[transformers-poss](https://pypi.org/project/transformers-poss/).

| | |
|---|---|
{table}

```python
import transformers_poss
from transformers_poss import PosSDraftModel

draft = PosSDraftModel.from_pretrained("{repo}")
out = target.generate(**inputs, assistant_model=draft, max_new_tokens=256)
```
{GENERATED_END}
"""


def build_model_card(model, repo: str = "PATH_OR_REPO", tags=None, metadata: dict | None = None,
                     metrics: dict | None = None):
    """The draft's `huggingface_hub.ModelCard`.

    Metadata: ``base_model`` (the target's Hub id), ``library_name``, ``pipeline_tag``, ``tags`` (the defaults, the
    loaded card's, ``model.model_tags`` and ``tags``), eval results from [`card_metrics`] (plus ``metrics``); other
    keys of a loaded card and ``metadata`` (e.g. ``license``, ``datasets``) are kept. Body: the generated summary,
    then ``model.model_card_extra``.
    """
    from huggingface_hub import ModelCard, ModelCardData

    loaded = dict(getattr(model, "_poss_card_metadata", None) or {})
    data = {k: v for k, v in loaded.items() if k not in _GENERATED_KEYS}
    data.update({k: v for k, v in (metadata or {}).items() if v is not None})
    all_tags = []
    extra_tags = [tags] if isinstance(tags, str) else tags
    for source in (CARD_TAGS, loaded.get("tags"), getattr(model, "model_tags", None), extra_tags):
        for tag in source or []:
            if tag not in all_tags:
                all_tags.append(tag)
    base = base_model_id(model.config.target_name_or_path) or loaded.get("base_model")
    figures = card_metrics(model, metrics)
    name = repo.rstrip("/").split("/")[-1] if repo and repo != "PATH_OR_REPO" else None
    card_data = ModelCardData(
        base_model=base,
        library_name=LIBRARY_NAME,
        pipeline_tag=PIPELINE_TAG,
        tags=all_tags,
        model_name=(name or "poss-draft") if figures else None,
        eval_results=_eval_results(figures, getattr(model, "training_recipe", None)) if figures else None,
        **data,
    )
    if not figures and loaded.get("model-index"):  # figures measured elsewhere stay on the card
        kept = _loaded_eval_results(loaded)
        if kept:
            card_data.model_name = loaded.get("model_name") or name or "poss-draft"
            card_data.eval_results = kept
    extra = getattr(model, "model_card_extra", None)
    body = _generated_body(model, repo) + ("\n" + extra.strip() + "\n" if extra and extra.strip() else "")
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{body}")


def _loaded_eval_results(loaded: dict):
    from huggingface_hub import ModelCardData

    try:
        return ModelCardData(**{"model-index": loaded["model-index"]}).eval_results
    except Exception:  # a malformed model-index is dropped rather than breaking the save
        return None


def render_model_card(model, repo: str = "PATH_OR_REPO", tags=None, **kwargs) -> str:
    """The README.md text for ``model`` (see [`build_model_card`])."""
    return str(build_model_card(model, repo=repo, tags=tags, **kwargs))


def write_model_card(model, save_directory: str, repo: str | None = None, tags=None, **kwargs) -> str:
    path = os.path.join(save_directory, CARD_FILE)
    repo = repo or os.path.basename(os.path.normpath(save_directory))
    build_model_card(model, repo=repo, tags=tags, **kwargs).save(path)
    return path


def split_card(text: str) -> tuple[dict, str | None]:
    """(metadata, hand-written part) of a README: the part after the generated section of a card written by this
    library, or the whole body of any other card."""
    from huggingface_hub import ModelCard

    card = ModelCard(text, ignore_metadata_errors=True)
    metadata = card.data.to_dict() if card.data is not None else {}
    body = card.text
    if GENERATED_END in body:
        extra = body.split(GENERATED_END, 1)[1]
    elif _LEGACY_END in body:
        extra = body.split(_LEGACY_END, 1)[1]
    else:
        extra = body
    extra = extra.strip()
    return metadata, extra or None


# ---------------------------------------------------------------------------------------------------- load / save
def _optional_file(name_or_path, filename: str, kwargs: dict) -> str | None:
    if os.path.isdir(str(name_or_path)):
        path = os.path.join(str(name_or_path), filename)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    try:
        return cached_file(
            name_or_path, filename, _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **{k: kwargs[k] for k in ("cache_dir", "local_files_only", "token", "revision") if k in kwargs},
        )
    except (OSError, ValueError):
        return None


def load_hub_files(model, name_or_path, kwargs: dict) -> None:
    """Read the card (its metadata and hand-written part) and ``training_recipe.json`` of a draft folder or repo."""
    recipe_path = _optional_file(name_or_path, RECIPE_FILE, kwargs)
    if recipe_path:
        try:
            with open(recipe_path, encoding="utf-8") as handle:
                model.training_recipe = json.load(handle)
        except (OSError, ValueError):
            model.training_recipe = None
    card_path = _optional_file(name_or_path, CARD_FILE, kwargs)
    if card_path:
        with open(card_path, encoding="utf-8") as handle:
            metadata, extra = split_card(handle.read())
        object.__setattr__(model, "_poss_card_metadata", metadata)
        if extra and not getattr(model, "model_card_extra", None):
            model.model_card_extra = extra


def save_draft_files(model, save_directory, repo: str | None = None, tags=None, **card_kwargs) -> list[str]:
    """Write the files saved beside the weights: generation config, card and recipe. Returns their names."""
    model.generation_config.save_pretrained(save_directory)
    write_model_card(model, save_directory, repo=repo, tags=tags, **card_kwargs)
    names = ["generation_config.json", CARD_FILE]
    recipe = getattr(model, "training_recipe", None)
    if recipe is not None:
        with open(os.path.join(save_directory, RECIPE_FILE), "w", encoding="utf-8") as handle:
            json.dump(recipe, handle, indent=2, default=str)
        names.append(RECIPE_FILE)
    return names


def _api():
    from huggingface_hub import HfApi

    return HfApi()


def _create_branch(api, repo_id, revision, token):
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)


def push_draft_to_hub(
    model,
    repo_id: str,
    commit_message: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: str | int = "50GB",
    commit_description: str | None = None,
    tags: list[str] | str | None = None,
):
    """`PushToHubMixin.push_to_hub` for drafts: the repo is created if needed, the draft is saved (weights, config,
    tree shape, its own card with ``tags``, the recipe) and uploaded in one commit with `HfApi.upload_folder`."""
    api = _api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    _create_branch(api, repo_id, revision, token)
    with tempfile.TemporaryDirectory() as tmp_dir:
        model.save_pretrained(tmp_dir, max_shard_size=max_shard_size, repo_id_for_card=repo_id, tags=tags)
        return api.upload_folder(
            repo_id=repo_id, folder_path=tmp_dir, commit_message=commit_message or "Upload PosS draft",
            commit_description=commit_description, token=token, revision=revision, create_pr=create_pr,
        )


def save_pretrained_with_card(model, parent_save, save_directory, args, kwargs):
    """``save_pretrained`` of a draft: transformers saves the weights and config, this adds the draft's files and,
    with ``push_to_hub=True``, uploads what this save wrote (transformers' own upload would send a generic card
    before the draft's files exist)."""
    push = bool(kwargs.pop("push_to_hub", False))
    tags = kwargs.pop("tags", None)
    card_repo = kwargs.pop("repo_id_for_card", None)
    hub = {}
    if push:
        hub = {key: kwargs.pop(key) for key in ("commit_message", "commit_description", "create_pr", "revision",
                                                 "private") if key in kwargs}
        hub["repo_id"] = kwargs.pop("repo_id", os.path.basename(os.path.normpath(str(save_directory))))
    install_trainer_card_hook()
    main = kwargs.get("is_main_process", args[0] if args else True)
    os.makedirs(save_directory, exist_ok=True)
    before = _timestamps(save_directory)
    parent_save(save_directory, *args, **kwargs)
    if not main:
        return None
    api = _api() if push else None
    token = kwargs.get("token")
    repo_id = None
    if push:
        repo_id = api.create_repo(hub["repo_id"], private=hub.get("private"), token=token, exist_ok=True).repo_id
    save_draft_files(model, save_directory, repo=repo_id or card_repo, tags=tags)
    if not push:
        return None
    after = _timestamps(save_directory)
    changed = sorted(name for name, stamp in after.items() if before.get(name) != stamp)
    _create_branch(api, repo_id, hub.get("revision"), token)
    return api.upload_folder(
        repo_id=repo_id, folder_path=str(save_directory), allow_patterns=changed,
        commit_message=hub.get("commit_message") or "Upload PosS draft",
        commit_description=hub.get("commit_description"), token=token,
        revision=hub.get("revision"), create_pr=hub.get("create_pr", False),
    )


def _timestamps(folder) -> dict[str, float]:
    return {name: os.path.getmtime(os.path.join(folder, name)) for name in os.listdir(folder)
            if os.path.isfile(os.path.join(folder, name))}


# ---------------------------------------------------------------------------------------------------- Trainer
_TRAINER_ORIGINAL = {}


def _trainer_create_model_card(self, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                               tasks=None, dataset_tags=None, dataset=None, dataset_args=None):
    """`Trainer.create_model_card`, writing the draft's own card when the trained model is a PosS draft."""
    from .generation import tree_draft_of

    draft = tree_draft_of(self.accelerator.unwrap_model(self.model)) if hasattr(self, "accelerator") else None
    if draft is None or getattr(self.model, "peft_config", None) is not None:
        return _TRAINER_ORIGINAL["create_model_card"](
            self, language=language, license=license, tags=tags, model_name=model_name,
            finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags, dataset=dataset,
            dataset_args=dataset_args,
        )
    if not self.is_world_process_zero():
        return None
    metrics = {}
    for record in getattr(self.state, "log_history", []):  # the last evaluation's figures
        if "eval_loss" in record:
            metrics = {k: v for k, v in record.items() if k.startswith("eval_")}
    datasets = dataset_tags or dataset
    metadata = {"license": license, "language": language,
                "datasets": [datasets] if isinstance(datasets, str) else datasets}
    repo = getattr(self, "hub_model_id", None) or model_name or os.path.basename(os.path.normpath(self.args.output_dir))
    write_model_card(draft, self.args.output_dir, repo=repo, tags=tags, metadata=metadata, metrics=metrics)
    return None


def install_trainer_card_hook() -> None:
    """Make ``Trainer.create_model_card`` (run by ``Trainer.push_to_hub``) write a draft's own card.

    Installed on the first ``save_pretrained`` of a draft once transformers' Trainer is imported (``push_to_hub``
    saves the model before it writes the card), so importing transformers_poss never imports the Trainer. Any
    other model keeps transformers' card."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None or "create_model_card" in _TRAINER_ORIGINAL:
        return
    trainer_class = trainer_module.Trainer
    _TRAINER_ORIGINAL["create_model_card"] = trainer_class.create_model_card
    trainer_class.create_model_card = _trainer_create_model_card


# ---------------------------------------------------------------------------------------------------- tree shape
def load_tree_generation_config(name_or_path, config, kwargs) -> GenerationConfig:
    """The saved generation config (tree shape) if there is one, else the tree defaults of ``config``."""
    try:
        loaded = GenerationConfig.from_pretrained(
            name_or_path,
            **{k: kwargs[k] for k in ("cache_dir", "local_files_only", "token", "revision") if k in kwargs},
        )
    except (OSError, ValueError):
        loaded = GenerationConfig()
    from .modeling_poss import TREE_GENERATION_KEYS

    for key in TREE_GENERATION_KEYS:
        if getattr(loaded, key, None) is None:
            setattr(loaded, key, getattr(config, key))
    return loaded
