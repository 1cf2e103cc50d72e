"""Hub plumbing of PosS drafts: model cards, uploads with the card, the tree shape in the generation config."""

from __future__ import annotations

import os
import tempfile

from transformers import GenerationConfig

from ._transformers_compat import upload_modified_files
from .checks import tree_value
from .configuration_poss import TREE_GENERATION_KEYS

CARD_TEMPLATE = """---
library_name: transformers-poss
tags:
- speculative-decoding
- poss
- draft-model
{base_model}---

# {title}

A PosS (Position Specialists) draft model for tree speculative decoding with
[transformers-poss](https://pypi.org/project/transformers-poss/).

| | |
|---|---|
| target model | {target} |
| target model type | {target_type} |
| specialists (S) | {S} |
| positions per specialist (N) | {N} |
| training depth (S x N) | {K} |
| draft vocabulary | {vocab} |
| default tree (depth / top-k / total tokens) | {depth} / {top_k} / {total} |

```python
import transformers_poss
from transformers_poss import PosSDraftModel

draft = PosSDraftModel.from_pretrained("{repo}")
out = target.generate(**inputs, assistant_model=draft, max_new_tokens=256)
```
{extra}"""


def render_model_card(model, repo: str = "PATH_OR_REPO") -> str:
    """The README.md text for ``model``; ``model.model_card_extra`` (str), if set, is appended."""
    config = model.config
    gen = model.generation_config
    target = config.target_name_or_path or "unknown"
    base = f"base_model: {target}\n" if config.target_name_or_path and "/" in target and not os.path.isabs(target) else ""
    vocab = f"{config.draft_vocab_size} of {config.vocab_size} tokens" if config.draft_vocab_size else f"full ({config.vocab_size})"
    title = f"PosS-{config.positions_per_specialist} draft for {target}" if config.num_specialists > 1 else f"Draft (S = 1) for {target}"
    return CARD_TEMPLATE.format(
        base_model=base,
        title=title,
        target=target,
        target_type=config.target_model_type or "unknown",
        S=config.num_specialists,
        N=config.positions_per_specialist,
        K=config.training_depth,
        vocab=vocab,
        depth=gen.tree_depth,
        top_k=gen.tree_top_k,
        total=gen.tree_total_tokens,
        repo=repo,
        extra=("\n" + model.model_card_extra.strip() + "\n") if getattr(model, "model_card_extra", None) else "",
    )


def write_model_card(model, save_directory: str, repo: str | None = None) -> str:
    path = os.path.join(save_directory, "README.md")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_model_card(model, repo=repo or os.path.basename(os.path.normpath(save_directory))))
    return path


def push_draft_to_hub(
    model,
    repo_id: str,
    commit_message: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: str = "50GB",
    commit_description: str | None = None,
    **kwargs,
):
    """Like `PushToHubMixin.push_to_hub`, but the uploaded README.md is the draft's own card, not a generic one."""
    from transformers.utils import hub

    repo_id = hub.hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as tmp_dir:
        model.save_pretrained(tmp_dir, max_shard_size=max_shard_size)
        write_model_card(model, tmp_dir, repo=repo_id)
        return upload_modified_files(
            model,
            tmp_dir,
            repo_id,
            commit_message=commit_message or "Upload PosS draft",
            token=token,
            create_pr=create_pr,
            revision=revision,
            commit_description=commit_description,
        )


def load_tree_generation_config(name_or_path, config, kwargs) -> GenerationConfig:
    """The saved generation config (tree shape) if there is one, else the tree defaults of ``config``."""
    try:
        loaded = GenerationConfig.from_pretrained(
            name_or_path,
            **{k: kwargs[k] for k in ("cache_dir", "local_files_only", "token", "revision") if k in kwargs},
        )
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
