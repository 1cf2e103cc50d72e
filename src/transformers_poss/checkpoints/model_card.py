"""The model card of a PosS draft, built with huggingface_hub's `ModelCard` / `ModelCardData`.

The card's metadata (``base_model``, ``library_name``, ``pipeline_tag``, tags, eval results) and a generated summary
are rewritten on every save; a hand-written part below the generated section (``model.model_card_extra``) and any
other metadata of a loaded card (license, datasets, ...) are kept. `checkpoints.hub` writes it, `checkpoints.loading`
reads it.
"""

from __future__ import annotations

import os

from transformers.utils import logging

logger = logging.get_logger(__name__)

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
# licences of known targets' Hub repositories: a draft trained on a target's outputs is published under its licence
TARGET_LICENSES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0",
    "google/gemma-3-270m": "gemma",
}
# the Hub id the card's usage snippet shows when the draft was saved to a local folder, not pushed
PLACEHOLDER_REPO = "your-name/your-draft"
_USAGE_NOTE = "   # the Hub id it is pushed to, or its folder"
# metadata regenerated on every save; any other key of a loaded card (license, datasets, language, ...) is kept
_GENERATED_KEYS = {"library_name", "pipeline_tag", "base_model", "tags", "model-index", "eval_results", "model_name"}

__all__ = ["PLACEHOLDER_REPO", "base_model_id", "build_model_card", "card_metrics", "render_model_card", "split_card", "write_model_card"]


# ---------------------------------------------------------------------------------------------------- the card
def _is_hub_id(name) -> bool:
    return (isinstance(name, str) and name.count("/") == 1 and not name.startswith((".", "/", "~"))
            and not os.path.exists(name))


def base_model_id(target: str | None) -> str | None:
    """The Hub id of the target for the card's ``base_model``: a Hub id as is, an embedded name (or its converted
    cache folder) mapped to the repo it comes from, a local folder saved from a Hub model by the ``_name_or_path``
    in its config.json; None when nothing says where the target comes from."""
    if not target:
        return None
    target = str(target)
    name = os.path.basename(os.path.normpath(target))
    if target in EMBEDDED_HUB_IDS or (os.path.isdir(target) and name in EMBEDDED_HUB_IDS):
        return EMBEDDED_HUB_IDS[name]
    if _is_hub_id(target):
        return target
    config = os.path.join(target, "config.json")
    if os.path.isfile(config):
        import json

        try:
            with open(config, encoding="utf-8") as handle:
                origin = json.load(handle).get("_name_or_path")
        except (OSError, ValueError):
            return None
        return origin if _is_hub_id(origin) else None
    return None


def usage_repo(repo: str | None) -> str:
    """The id the card's snippet loads: ``repo`` when it is a Hub id, else `PLACEHOLDER_REPO` (never a local path)."""
    return repo if _is_hub_id(repo) else PLACEHOLDER_REPO


def portable(value):
    """``value`` (a recipe: dicts, lists, strings) with absolute local paths cut to ``.../NAME``: a card is public."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if isinstance(value, str) and (os.path.isabs(value) or value.startswith("~")):
        return ".../" + os.path.basename(os.path.normpath(value))
    return value


def _default_name(model) -> str:
    """model-index name of a draft saved locally: what it drafts for, e.g. ``poss2-SmolLM2-135M-Instruct``."""
    config = model.config
    base = base_model_id(config.target_name_or_path)
    kind = f"poss{config.positions_per_specialist}" if config.num_specialists > 1 else "draft"
    return f"{kind}-{base.split('/')[-1]}" if base else f"{kind}-draft"


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


def _features_row(config) -> str:
    """What the draft reads from the target: the post-norm state, or its feature layers (EAGLE-3 style)."""
    layers = getattr(config, "feature_layers", None)
    if layers is None:
        return "post-final-norm hidden state"
    return f"feature layers {layers} (hidden_states indices, concatenated: {config.target_feature_size} wide)"


def _generated_body(model, repo: str) -> str:
    config, gen = model.config, model.generation_config
    target = base_model_id(config.target_name_or_path) or portable(config.target_name_or_path) or "unknown"
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
        ("target features", _features_row(config)),
        ("layer style", f"{config.layer_style}" + (", own lm_head" if config.own_lm_head else "")),
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

draft = PosSDraftModel.from_pretrained("{usage_repo(repo)}"){_USAGE_NOTE if usage_repo(repo) == PLACEHOLDER_REPO else ""}
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
    if base is None:
        logger.warning("The card has no base_model: the draft's target %r is not a Hub id; pass "
                       "metadata={'base_model': 'org/name'} or save a draft made for the Hub model.",
                       model.config.target_name_or_path)
    if "license" not in data and TARGET_LICENSES.get(base):
        data["license"] = TARGET_LICENSES[base]  # the target's licence, unless the card or the caller sets one
    figures = card_metrics(model, metrics)
    name = repo.rstrip("/").split("/")[-1] if _is_hub_id(repo) else _default_name(model)
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
    """Write ``save_directory/README.md``; ``repo`` (the Hub id) names the draft in it, else a placeholder does."""
    path = os.path.join(save_directory, CARD_FILE)
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
