"""Training PosS drafts (and EAGLE-2 / HASS drafts, the single-specialist cases) with the transformers Trainer.

- [`data`]: conversations -> chat-template token ids with an assistant-only mask.
- [`distill`]: self-distillation (regenerate answers with the target; synthesise prompts without a dataset).
- [`feature_inputs`] / [`features`]: target features online (inside the training step) or offline (bf16 safetensors
  shards); the post-norm feature or, for ``feature_layers`` drafts (EAGLE-3 style), several target layers.
- [`objective`]: the multi-step HASS-aligned objective with position specialists (``training_forward``); EAGLE-3's
  token-only objective is ``EAGLE3_OBJECTIVE``.
- [`trainer`]: ``PosSTrainer`` / ``PosSTrainingArguments``.
- [`warm_start`]: specialists started from a trained draft (``init_specialists``), EAGLE-2 -> multi-layer warm start.

Submodules are imported lazily so that ``import transformers_poss`` stays light.
"""

import importlib

_EXPORTS = {
    "ObjectiveConfig": "objective",
    "EAGLE3_OBJECTIVE": "objective",
    "training_forward": "objective",
    "PosSTrainer": "trainer",
    "PosSTrainingArguments": "trainer",
    "init_specialists": "warm_start",
    "fit_feature_fc": "warm_start",
    "PositionAccuracyCallback": "trainer",
    "TimeLimitCallback": "trainer",
    "evaluate_draft": "trainer",
    "pair_loss_mask": "data",
    "regenerate": "distill",
    "synthesize_prompts": "distill",
    "ConversationDataset": "data",
    "tokenize_conversation": "data",
    "load_conversations": "data",
    "PosSDataCollator": "features",
    "TargetFeatures": "features",
    "write_feature_shards": "features",
    "FeatureShardDataset": "features",
    "check_feature_layout": "features",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
