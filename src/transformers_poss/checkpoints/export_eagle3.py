"""A one-specialist ``layer_style="eagle3"`` draft as an EAGLE-3 checkpoint (vLLM ``method="eagle3"``, SGLang
``--speculative-algorithm EAGLE3``, the SafeAILab/EAGLE and SpecForge layout): `export_eagle3`.

The inverse of `official_eagle3` (``from_official`` reads the folder back): a Llama ``config.json`` with
``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, the layer shape and rope, the target's
``vocab_size``, ``draft_vocab_size``, ``target_hidden_size`` and the target layers as
``eagle_aux_hidden_state_layer_ids`` (top level and in ``eagle_config``, with ``use_aux_hidden_state: true``); tensors
``midlayer.*`` (from ``layers.0.*``), ``fc.weight`` (from ``feature_fc``), ``norm.weight``, ``lm_head.weight``,
``d2t`` (target id - draft id) and ``t2d`` (the target tokens of the draft vocabulary), ``embed_tokens.weight`` only
for a draft with its own embedding.

Only what the format holds is exported: one specialist (the engines run one layer at every draft position), feature
layers, the draft's own lm_head, silu, a target that does not scale its embeddings inside the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .export import _SCALED_EMBEDDING_TYPES, ExportError, _draft, _source_folder, eagle_config
from .folders import check_output_folder, staged_folder

__all__ = ["export_eagle3", "eagle3_export_config", "eagle3_export_state_dict", "check_eagle3_compatible"]


def check_eagle3_compatible(draft) -> None:
    """Raise an `ExportError` saying why ``draft`` cannot be an EAGLE-3 checkpoint."""
    config = draft.config
    problems = []
    if config.num_specialists != 1:
        problems.append(f"it has {config.num_specialists} position specialists (the engines run one layer at every "
                        "draft position)")
    if config.layer_style != "eagle3":
        problems.append(f"its layers are {config.layer_style}-style (EAGLE-3 checkpoints hold an eagle3 midlayer)")
    if config.feature_layers is None:
        problems.append("it reads only the post-norm feature (EAGLE-3 checkpoints fuse feature layers)")
    if not config.own_lm_head:
        problems.append("it borrows the target's lm_head (EAGLE-3 checkpoints carry their own)")
    if (config.target_model_type or "") in _SCALED_EMBEDDING_TYPES:
        problems.append(f"its target ({config.target_model_type}) scales its input embeddings inside the model")
    if config.hidden_act != "silu":
        problems.append(f"it uses {config.hidden_act!r}, the engines' Llama layer silu")
    if problems:
        raise ExportError("This draft cannot be an EAGLE-3 checkpoint: " + "; ".join(problems) + ". Serve it with "
                          "transformers (`poss export --format custom_generate`).")


def eagle3_export_config(draft, dtype: torch.dtype | None = None) -> dict:
    """The ``config.json`` of the EAGLE-3 checkpoint of ``draft``."""
    config = draft.config
    out = eagle_config(draft, dtype, engine="vllm")  # the shared Llama fields (shape, rope, vocab, tokens, dtype)
    out.pop("eagle_fc_bias")
    layers = list(config.feature_layers)
    out.update(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=config.draft_vocab_size or config.vocab_size,
        target_hidden_size=config.hidden_size,
        eagle_aux_hidden_state_layer_ids=layers,
        eagle_config={"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
    )
    out["transformers_poss"] = {**out["transformers_poss"], "format": "eagle3"}
    return out


def eagle3_export_state_dict(draft, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The flat EAGLE-3 tensors of ``draft`` (see the module docstring), on the CPU, contiguous."""
    dtype = dtype or next(draft.parameters()).dtype
    state = {f"midlayer.{name}": value for name, value in draft.layers[0].state_dict().items()}
    state.update({"fc.weight": draft.feature_fc.weight, "norm.weight": draft.norm.weight,
                  "lm_head.weight": draft.lm_head.weight})
    if draft.embed_tokens is not None:
        state["embed_tokens.weight"] = draft.embed_tokens.weight
    out = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    vocab, draft_vocab = draft.config.vocab_size, draft.lm_head.weight.shape[0]
    mapping = torch.arange(draft_vocab) if draft.draft_to_target is None else draft.draft_to_target.detach().cpu()
    out["d2t"] = (mapping - torch.arange(draft_vocab)).long().contiguous()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[mapping] = True
    out["t2d"] = t2d
    return out


def export_eagle3(model, output_dir, dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` (a one-specialist eagle3-style draft) as an EAGLE-3 checkpoint folder; returns the folder.

    A non-empty folder is refused unless ``overwrite`` (then config.json and model.safetensors are replaced, other
    files stay); the folder the draft was loaded from is always refused."""
    from safetensors.torch import save_file

    draft = _draft(model)
    check_eagle3_compatible(draft)
    output_dir = check_output_folder(output_dir, overwrite, source=_source_folder(draft))
    with staged_folder(output_dir) as staging:
        (staging / "config.json").write_text(json.dumps(eagle3_export_config(draft, dtype), indent=2) + "\n")
        save_file(eagle3_export_state_dict(draft, dtype), str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
    return output_dir
