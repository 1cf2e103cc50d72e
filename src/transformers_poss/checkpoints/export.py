"""Drafts for serving engines and for transformers' ``custom_generate``: `export_eagle`, `export_custom_generate`
(the EAGLE-3 layout: `export_eagle3`).

EAGLE format (vLLM ``method="eagle"``, SGLang ``--speculative-algorithm EAGLE``, the EAGLE repository): one folder
with a Llama ``config.json`` and ``model.safetensors`` holding one draft layer,

- config: ``architectures: ["LlamaForCausalLM"]`` (vLLM, whose ``EAGLEConfig`` turns it into ``EagleLlamaForCausalLM``,
  and the EAGLE repository) or ``["LlamaForCausalLMEagle"]`` (SGLang, which picks the model class from it; the
  only difference between the two), ``model_type: "llama"``, ``num_hidden_layers: 1``, the layer shape
  (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``hidden_act``, ``rms_norm_eps``), ``rope_theta`` / ``rope_scaling``, ``max_position_embeddings``, the target's
  full ``vocab_size`` and special token ids, ``tie_word_embeddings: false``, ``torch_dtype``, ``eagle_fc_bias``;
  no ``bias`` key (vLLM's Llama layers read it as an attention bias);
- tensors: ``fc.weight`` `[H, 2H]`, ``fc.bias`` `[H]` (zeros for a draft without bias, since SGLang's and the EAGLE
  repository's ``fc`` always have one), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``; no
  ``input_layernorm`` (the engines skip it on the first draft layer, as this draft does), no ``lm_head`` (the
  target's is used), ``embed_tokens.weight`` only for a draft with its own embedding.

Only single-specialist drafts (EAGLE-2, HASS: S = 1) fit: the engines run the same layer at every draft position,
so a PosS draft, whose positions use different layers, is refused; so is a draft that reads several target layers
or has EAGLE-3 style layers (see `export_eagle3`). A reduced draft vocabulary is not part of the
EAGLE format of vLLM; the layer itself does not depend on it, so the checkpoint drafts over the full vocabulary,
and the token map is written beside it as ``hot_token_ids.pt`` for SGLang's ``--speculative-token-map``.

``custom_generate`` folder: the draft saved as usual plus ``custom_generate/generate.py`` and
``custom_generate/requirements.txt`` and a README tagged ``custom_generate``, so that
``target.generate(**inputs, custom_generate=folder, trust_remote_code=True)`` runs tree speculation with this draft
without the caller importing transformers_poss (the folder's ``generate.py`` does).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from ..checks import TREE_KEYS
from .folders import check_output_folder, staged_folder
from ..modeling_poss import PosSDraftModel

logger = logging.getLogger(__name__)

__all__ = ["export_eagle", "export_custom_generate", "eagle_config", "eagle_state_dict", "EAGLE_TOKEN_MAP_FILE",
           "ExportError"]

EAGLE_TOKEN_MAP_FILE = "hot_token_ids.pt"
REDUCED_VOCAB_CHOICES = ("token-map", "full", "error")
ENGINE_ARCHITECTURES = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
# targets whose input embedding is scaled inside the model (sqrt(H) for Gemma): an engine hands the draft the
# unscaled table, so the draft would see other inputs than it was trained on
_SCALED_EMBEDDING_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text")
_LAYER_PARTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "post_attention_layernorm.weight")


class ExportError(ValueError):
    """A draft that the requested export format cannot represent."""


def _draft(model) -> PosSDraftModel:
    from ..generation import tree_draft_of

    draft = tree_draft_of(model)
    if draft is None:
        raise TypeError(f"Expected a PosSDraftModel (or a PeftModel around one), got {type(model).__name__}.")
    if getattr(draft, "_poss_quantized", None):
        raise ExportError("This draft is quantized (Int8Linear); export the float draft (quantize after loading).")
    return draft


def check_eagle_compatible(draft) -> None:
    """Raise an `ExportError` saying why ``draft`` cannot be an EAGLE checkpoint for vLLM / SGLang."""
    config = draft.config
    if config.num_specialists != 1:
        raise ExportError(
            f"This draft has {config.num_specialists} position specialists (PosS-{config.positions_per_specialist}: "
            f"draft positions 1..{config.positions_per_specialist} use layer 0, the next ones layer 1, ...). "
            "vLLM's and SGLang's EAGLE drafting runs the same single layer for every draft position, so they cannot "
            "express it; exporting one layer would silently change what the draft proposes. Serve it with transformers "
            "(`export_custom_generate`, `poss export --format custom_generate`), or train an S = 1 draft "
            "(EAGLE-2 / HASS) for the engines."
        )
    if config.feature_layers is not None or config.layer_style != "eagle2" or config.own_lm_head:
        what = [f"reads the target layers {config.feature_layers}" if config.feature_layers is not None else None,
                "has EAGLE-3 style layers" if config.layer_style != "eagle2" else None,
                "has its own lm_head" if config.own_lm_head else None]
        raise ExportError(
            f"This draft {' and '.join(w for w in what if w)}, which the EAGLE(-2) format (fc over one post-norm "
            "feature, one layer without input norm, the target's lm_head) cannot express. A one-specialist "
            "eagle3-style draft with feature layers and its own lm_head exports to the EAGLE-3 layout instead "
            "(`export_eagle3`, `poss export --format eagle3`); otherwise serve it with transformers "
            "(`poss export --format custom_generate`)."
        )
    if (config.target_model_type or "") in _SCALED_EMBEDDING_TYPES:
        raise ExportError(
            f"The target ({config.target_model_type}) scales its input embeddings inside the model; the engines hand "
            "an EAGLE draft the unscaled embedding table, so this draft would not see the inputs it was trained on."
        )
    if config.hidden_act != "silu":
        raise ExportError(f"The EAGLE format's Llama layer uses silu; this draft uses {config.hidden_act!r}.")


def eagle_config(draft, dtype: torch.dtype | None = None, engine: str = "vllm") -> dict:
    """The Llama ``config.json`` of the EAGLE checkpoint of ``draft`` for ``engine`` (``"vllm"`` or ``"sglang"``)."""
    if engine not in ENGINE_ARCHITECTURES:
        raise ValueError(f"engine must be one of {sorted(ENGINE_ARCHITECTURES)}, got {engine!r}.")
    config = draft.config
    rope = dict(config.rope_parameters or {})
    rope_theta = float(rope.pop("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", "default")
    dtype = dtype or next(draft.parameters()).dtype
    out = {
        "architectures": [ENGINE_ARCHITECTURES[engine]],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": None if rope_type == "default" else {**rope, "rope_type": rope_type},
        "vocab_size": config.vocab_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_fc_bias": True,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "initializer_range": config.initializer_range,
        "use_cache": True,
        "transformers_poss": {
            "format": "eagle",
            "target_name_or_path": config.target_name_or_path,
            "target_model_type": config.target_model_type,
            "fc_bias_trained": bool(config.fc_bias),
            "draft_vocab_size": config.draft_vocab_size,
            "positions_per_specialist": config.positions_per_specialist,
            "generation": tree_settings(draft),
        },
    }
    return out


def tree_settings(draft) -> dict:
    """The draft's tree shape (``tree_depth``, ``tree_top_k``, ``tree_total_tokens``), kept in an exported config's
    ``transformers_poss`` section so that converting the checkpoint back restores it."""
    return {key: getattr(draft.generation_config, key, None) for key in TREE_KEYS}


def _source_folder(draft) -> str | None:
    """The local folder ``draft`` was loaded from (None for a draft built in memory or read from the Hub cache)."""
    name = getattr(draft.config, "_name_or_path", None) or getattr(draft, "name_or_path", None)
    return name if name and os.path.isdir(str(name)) else None


def eagle_state_dict(draft, dtype: torch.dtype | None = None, fc_bias: bool = True) -> dict[str, torch.Tensor]:
    """The flat EAGLE tensors of ``draft`` (see the module docstring), on the CPU, contiguous."""
    dtype = dtype or next(draft.parameters()).dtype
    state = {"fc.weight": draft.fc.weight}
    if fc_bias:
        state["fc.bias"] = draft.fc.bias if draft.fc.bias is not None else torch.zeros(draft.config.hidden_size)
    layer = draft.layers[0].state_dict()
    for part in _LAYER_PARTS:
        state[f"layers.0.{part}"] = layer[part]
    if draft.embed_tokens is not None:
        state["embed_tokens.weight"] = draft.embed_tokens.weight
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}


def export_eagle(model, output_dir, engine: str = "vllm", reduced_vocab: str = "token-map", fc_bias: bool = True,
                 dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` (an S = 1 draft) as an EAGLE checkpoint folder for vLLM / SGLang; returns the folder.

    Args:
        engine: ``"vllm"`` (also the EAGLE repository's layout) or ``"sglang"``: sets ``architectures``.
        reduced_vocab: for a draft with a reduced drafting vocabulary: ``"token-map"`` (default) writes the
            full-vocabulary checkpoint and the map as ``hot_token_ids.pt`` (SGLang ``--speculative-token-map``;
            vLLM drafts over the full vocabulary); ``"full"`` drops the map; ``"error"`` refuses.
        fc_bias: write ``fc.bias`` (zeros when the draft has none). ``False`` leaves it out, for vLLM releases whose
            EAGLE ``fc`` has no bias and refuse the tensor; refused when the draft's bias is not zero.
        dtype: storage dtype (default: the draft's).
        overwrite: write into a non-empty folder, replacing the files written here (others stay); without it such a
            folder is refused (`folders.check_output_folder`), as is the folder the draft was loaded from.
    """
    from safetensors.torch import save_file

    draft = _draft(model)
    check_eagle_compatible(draft)
    output_dir = check_output_folder(output_dir, overwrite, source=_source_folder(draft))
    if reduced_vocab not in REDUCED_VOCAB_CHOICES:
        raise ValueError(f"reduced_vocab must be one of {REDUCED_VOCAB_CHOICES}, got {reduced_vocab!r}.")
    token_map = draft.draft_to_target
    if token_map is not None and reduced_vocab == "error":
        raise ExportError(
            f"This draft drafts over a reduced vocabulary of {draft.config.draft_vocab_size} tokens, which vLLM's "
            "EAGLE format cannot represent. Export with reduced_vocab='full' (draft over the full vocabulary; the "
            "layer is unchanged) or 'token-map' (also writes hot_token_ids.pt for SGLang's --speculative-token-map)."
        )
    if not fc_bias and draft.fc.bias is not None and bool(draft.fc.bias.detach().abs().max() > 0):
        raise ExportError("fc_bias=False would drop this draft's non-zero fc bias (the engine would compute another "
                          "draft); keep it, or train the draft with fc_bias=False.")
    config = eagle_config(draft, dtype, engine=engine)
    config["eagle_fc_bias"] = bool(fc_bias)
    keep_map = token_map is not None and reduced_vocab == "token-map"
    if not keep_map:
        config["transformers_poss"]["draft_vocab_size"] = None
    with staged_folder(output_dir) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(eagle_state_dict(draft, dtype, fc_bias=fc_bias), str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        if keep_map:
            torch.save(token_map.detach().cpu().long().clone(), str(staging / EAGLE_TOKEN_MAP_FILE))
    stale = output_dir / EAGLE_TOKEN_MAP_FILE
    if keep_map:
        logger.info("Reduced vocabulary: the EAGLE checkpoint drafts over the full vocabulary; %s holds the %d-token "
                    "map for SGLang's --speculative-token-map (and for converting it back).", EAGLE_TOKEN_MAP_FILE,
                    token_map.numel())
    else:
        if token_map is not None:
            logger.warning("reduced_vocab='full': the %d-token drafting vocabulary is not written; the checkpoint (and "
                           "a draft converted back from it) drafts over the full vocabulary.", token_map.numel())
        if stale.exists():
            stale.unlink()
    if draft.embed_tokens is not None:
        logger.warning("This draft carries its own token embedding; vLLM (without pipeline parallelism) and SGLang "
                       "use the target's embedding for EAGLE drafts instead.")
    return output_dir


# ---------------------------------------------------------------------------------------------------- custom_generate
_GENERATE_PY = '''"""Tree speculative decoding with a PosS draft, as a transformers `custom_generate` method.

    target.generate(**inputs, custom_generate=FOLDER_OR_REPO, trust_remote_code=True)

runs PosS / EAGLE-2 tree speculation with the draft stored in the folder or repository this code was loaded from
(wherever it was copied or moved; or `assistant_model=`: a loaded draft, a PeftModel around one, or a folder / Hub
id of one). Output and arguments are those of `generate`
(greedy output identical to plain decoding); with `return_dict_in_generate=True` the result also carries
`acceptance` (mean acceptance length, position-wise acceptance). Written by `poss export --format custom_generate`.
"""

DEFAULT_DRAFT = {default_draft!r}  # used only when the calling generate() does not name this folder / repository


def generate(model, *args, assistant_model=None, **kwargs):
    from transformers_poss.checkpoints.export import run_custom_generate

    return run_custom_generate(model, *args, assistant_model=assistant_model, default_draft=DEFAULT_DRAFT,
                               from_caller=True, **kwargs)
'''

_README_USAGE = """## `custom_generate`: tree speculation without importing transformers-poss

This repository is also a transformers
[`custom_generate`](https://huggingface.co/docs/transformers/generation_strategies#custom-generation-methods) method:

```
from transformers import AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained("{target}")
tokenizer = AutoTokenizer.from_pretrained("{target}")
inputs = tokenizer("The capital of France is", return_tensors="pt")
out = target.generate(**inputs, custom_generate="{location}", trust_remote_code=True, max_new_tokens=64)
```

- Base model: `{target}` (the draft is made for it; another target is refused).
- Arguments: those of `generate`; `assistant_model` (optional) is this draft by default, or a loaded PosS draft, a
  `PeftModel` around one, or the folder / Hub id of one. The tree shape is the draft's `generation_config`
  (`tree_depth`, `tree_top_k`, `tree_total_tokens`).
- Output: as `generate`; greedy output is identical to plain decoding. With `return_dict_in_generate=True` it also
  has `acceptance` (tokens per target forward, position-wise acceptance).
- Requirements (`custom_generate/requirements.txt`): `transformers-poss`, imported by `custom_generate/generate.py`
  (which makes `generate` tree-aware in that process).
"""

_DRAFT_CACHE: dict[str, PosSDraftModel] = {}


def _resolve_draft(assistant_model, default_draft, from_caller: bool = False):
    from .._transformers_compat import custom_generate_location
    from ..generation import tree_draft_of

    if assistant_model is None and from_caller:  # the folder / repo the running generate(custom_generate=...) names
        assistant_model = custom_generate_location()
    if assistant_model is None:
        assistant_model = default_draft
    if assistant_model is None:
        raise ValueError("No draft: pass assistant_model= (a PosS draft, or its folder / Hub id).")
    if isinstance(assistant_model, (str, os.PathLike)):
        key = str(assistant_model)
        if key not in _DRAFT_CACHE:
            _DRAFT_CACHE[key] = PosSDraftModel.from_pretrained(key)
        return _DRAFT_CACHE[key]
    if tree_draft_of(assistant_model) is None:
        raise TypeError(f"assistant_model must be a PosS draft (or its folder / Hub id), got "
                        f"{type(assistant_model).__name__}; for other assistants call generate without "
                        "custom_generate.")
    return assistant_model


def run_custom_generate(model, *args, assistant_model=None, default_draft=None, from_caller: bool = False, **kwargs):
    """What an exported folder's ``custom_generate/generate.py`` runs: the stock ``generate`` with a PosS draft.

    The draft: ``assistant_model`` if given; else (``from_caller``) the folder or Hub id the running
    ``generate(custom_generate=...)`` call loaded the code from, so a copied or moved folder uses its own draft; else
    ``default_draft`` (the ``repo_id`` given at export)."""
    from ..generation import enable_tree_generation

    enable_tree_generation()
    draft = _resolve_draft(assistant_model, default_draft, from_caller=from_caller)
    return model.generate(*args, assistant_model=draft, **kwargs)


def _requirement() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"transformers-poss>={version('transformers-poss')}"
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
        return "transformers-poss"


def export_custom_generate(model, output_dir, repo_id: str | None = None, tags=None, overwrite: bool = False) -> Path:
    """Write ``model`` as a draft folder that is also a transformers ``custom_generate`` repository.

    The folder holds the saved draft (weights, config, tree shape, card tagged ``custom_generate``) and
    ``custom_generate/generate.py`` + ``requirements.txt``. ``generate.py`` records no local path: it loads the draft
    from the folder or repository ``generate(custom_generate=...)`` names, so the folder can be copied, moved or
    pushed. ``repo_id``: where the folder will live on the Hub (the card's usage, and the fallback draft of
    ``generate.py``). A non-empty folder is refused unless ``overwrite`` (then the files written here are replaced,
    others stay; the draft's own folder is accepted). Any draft works here, PosS drafts included.
    """
    draft = _draft(model)
    output_dir = check_output_folder(output_dir, overwrite, source=_source_folder(draft), allow_source=True)
    location = repo_id or str(output_dir)
    previous = draft.model_card_extra
    target = draft.config.target_name_or_path or "TARGET"
    usage = _README_USAGE.format(target=target, location=location)
    if previous and "## `custom_generate`" in previous:  # exported before: the section is already there
        draft.model_card_extra = previous
    else:
        draft.model_card_extra = (previous.rstrip() + "\n\n" if previous else "") + usage
    try:
        card_tags = ["custom_generate", *([tags] if isinstance(tags, str) else tags or [])]
        with staged_folder(output_dir) as staging:
            draft.save_pretrained(staging, tags=card_tags, repo_id_for_card=repo_id)
            code = staging / "custom_generate"
            code.mkdir()
            (code / "generate.py").write_text(_GENERATE_PY.replace("{default_draft!r}", repr(repo_id)))
            (code / "requirements.txt").write_text(_requirement() + "\n")
    finally:
        draft.model_card_extra = previous
    return output_dir
