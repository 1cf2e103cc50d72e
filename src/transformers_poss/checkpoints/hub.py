"""Saving and uploading PosS drafts: the files that travel with a draft, uploads, the Trainer's card hook.

A saved draft folder holds ``model.safetensors``, ``config.json``, ``generation_config.json`` (the tree shape),
``README.md`` (the draft's own card, built with huggingface_hub's `ModelCard` / `ModelCardData`) and, when the draft
carries one, ``training_recipe.json``. Loading a folder or Hub repo reads the card and the recipe back, so a hand
written part of the card (``model.model_card_extra``) and the recipe survive load -> save -> push (the reading side
is in `loading`).

Uploads go through huggingface_hub's public API (`HfApi.create_repo`, `HfApi.upload_folder`), for
``draft.push_to_hub(...)``, ``draft.save_pretrained(path, push_to_hub=True)`` and the Trainer's ``push_to_hub``
(whose generic card is replaced by the draft's own, see `install_trainer_card_hook`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from ..configuration_poss import PosSDraftConfig
from .loading import load_hub_files, load_tree_generation_config  # the reading side, re-exported
from .model_card import (CARD_FILE, RECIPE_FILE, base_model_id, build_model_card, card_metrics, render_model_card,
                         split_card, write_model_card)

__all__ = [
    "build_model_card", "render_model_card", "write_model_card", "card_metrics", "push_draft_to_hub",
    "save_draft_files", "load_hub_files", "install_trainer_card_hook", "load_tree_generation_config",
    "base_model_id", "split_card",
]


# ---------------------------------------------------------------------------------------------------- save
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
    draft = self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else None
    is_draft = isinstance(getattr(draft, "config", None), PosSDraftConfig)  # a PeftModel keeps peft's card below
    if not is_draft or getattr(self.model, "peft_config", None) is not None:
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
