"""Model cards for PosS drafts (written by `save_pretrained`, so `push_to_hub` uploads them)."""

from __future__ import annotations

import os

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
