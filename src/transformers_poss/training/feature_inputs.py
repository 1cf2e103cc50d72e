"""What a draft reads in training: target features computed online, their layout, and collated batches.

A draft reads either the target's post-final-norm feature f_t (``config.feature_layers`` None) or, EAGLE-3 style, k
of the target's hidden states concatenated (``config.feature_layers``: indices into transformers' ``hidden_states``
tuple, 0 = embedding output, ``num_hidden_layers`` = post-final-norm), `[.., k * H]`. The token loss always needs the
post-norm feature f_{t+1} as well (the target's ``lm_head`` gives the soft labels from it), so a multi-layer batch
carries it beside the draft's input features (``target_last_hidden_state``). Offline shards: [`features`].
"""

from __future__ import annotations

import torch

from .data import pair_loss_mask
from .feature_attention import block_causal_features

__all__ = ["TargetFeatures", "PosSDataCollator", "batch_to", "draft_inputs", "with_target_features",
           "check_feature_layout", "describe_layers", "draft_feature_layers"]


def draft_feature_layers(draft_or_config) -> list[int] | None:
    """The target layers a draft (or draft config, or a list of layers) reads, or None for the post-norm feature."""
    if draft_or_config is None or isinstance(draft_or_config, (list, tuple)):
        return list(draft_or_config) if draft_or_config else None
    config = getattr(draft_or_config, "config", draft_or_config)
    layers = getattr(config, "feature_layers", None)
    return list(layers) if layers else None


def describe_layers(layers) -> str:
    """``layers`` in words, for messages."""
    return "the post-norm feature only (feature_layers=None)" if not layers else f"feature_layers={list(layers)}"


def check_feature_layout(stored_layers, draft, where: str = "these features") -> None:
    """Refuse features whose layers are not the ones ``draft`` (a draft, its config or a list of layers) reads, with a
    ValueError saying what to do."""
    wanted = draft_feature_layers(draft)
    stored = list(stored_layers) if stored_layers else None
    if stored != wanted:
        raise ValueError(f"{where} hold {describe_layers(stored)}, but this draft reads {describe_layers(wanted)}: "
                         "compute the features for the draft's layers into another folder (--features_dir) or use a "
                         "draft with the same feature_layers.")


class TargetFeatures:
    """Computes the target features a draft reads, without the lm_head. The target is frozen and put in eval mode.

    ``feature_layers`` None: the post-final-norm features f_t. Otherwise the hidden states at those indices of the
    transformers ``hidden_states`` tuple, concatenated in that order; only those are kept by the target's forward
    (``output_hidden_states`` given as the list of indices). Works with a transformers causal LM and with a
    `peft.PeftModel` around one (adapters stay active). On CPUs an SDPA target attends in query blocks for the
    call (right-padded batches: the same features, about 2x faster attention; see [`feature_attention`]).
    """

    def __init__(self, target, feature_layers: list[int] | None = None):
        self.target = target
        target.requires_grad_(False)
        target.eval()
        base = target.get_base_model() if hasattr(target, "get_base_model") else target
        self.decoder = base.get_decoder()
        self.feature_layers = list(feature_layers) if feature_layers else None
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        self.num_hidden_layers = count = getattr(config, "num_hidden_layers", None)
        if self.feature_layers:
            bad = [i for i in self.feature_layers
                   if isinstance(i, bool) or not isinstance(i, int) or count is None or not 0 <= i <= count]
            if bad:
                raise ValueError(f"feature_layers {self.feature_layers}: {bad} not in [0, {count}] (0 = embedding "
                                 f"output, {count} = post-norm feature of this {count}-layer target).")

    @torch.no_grad()
    def compute(self, tokens: torch.LongTensor, attention_mask: torch.Tensor | None = None):
        """`[B, L]` tokens (right-padded) -> ``(features [B, L, k * H], post-norm features [B, L, H])``; the two are
        the same tensor without ``feature_layers``."""
        with block_causal_features(self.decoder, tokens, attention_mask):
            out = self.decoder(input_ids=tokens, attention_mask=attention_mask, use_cache=False,
                               output_hidden_states=self.feature_layers or None)
        if not self.feature_layers:
            return out.last_hidden_state, out.last_hidden_state
        states = out.hidden_states
        if len(states) != self.num_hidden_layers + 1 or any(states[i] is None for i in self.feature_layers):
            raise RuntimeError(f"the target returned {len(states)} hidden states, not the {self.num_hidden_layers + 1} "
                               "expected; its decoder does not follow transformers' hidden_states convention.")
        return torch.cat([states[i] for i in self.feature_layers], dim=-1), out.last_hidden_state

    def __call__(self, tokens: torch.LongTensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, L]` tokens (right-padded) -> `[B, L, k * H]` features the draft reads (`[B, L, H]`: f_t)."""
        return self.compute(tokens, attention_mask)[0]

    def draft_inputs(self, tokens, loss_mask, attention_mask, pad_token_id: int = 0) -> dict:
        """The draft's training inputs for a token batch (see `draft_inputs`)."""
        features, last = self.compute(tokens, attention_mask)
        return draft_inputs(tokens, loss_mask, features, pad_token_id, None if last is features else last)


def with_target_features(batch: dict, features: "TargetFeatures | None", pad_token_id: int, missing: str) -> dict:
    """``batch`` ready for the draft's forward: a token batch (online features) gets the target's features from
    ``features``, a batch with stored features passes through; a token batch without ``features`` raises ``missing``."""
    if "tokens" not in batch:
        return batch
    if features is None:
        raise ValueError(missing)
    return features.draft_inputs(batch["tokens"], batch["loss_mask"], batch["attention_mask"], pad_token_id)


def batch_to(batch: dict, device) -> dict:
    """A collated batch with its tensors moved to ``device`` (other entries unchanged)."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def draft_inputs(tokens, loss_mask, features, pad_token_id: int = 0, last_hidden_state=None) -> dict:
    """Draft training inputs from a token batch: pair t = (f_t, x_{t+1}); the last pair gets a pad token.

    ``features`` (`[B, L, k * H]`) are what the draft reads; ``last_hidden_state`` (`[B, L, H]`, the target's
    post-norm features) is given for multi-layer features, for the token loss.
    """
    next_tokens = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], pad_token_id)], dim=1)
    out = {"input_ids": next_tokens, "target_hidden_states": features, "loss_mask": loss_mask}
    if last_hidden_state is not None:
        out["target_last_hidden_state"] = last_hidden_state
    return out


class PosSDataCollator:
    """Right-pads examples ``{"input_ids": [L], "assistant_mask": [L], ("hidden_states": [L, k * H],
    ("last_hidden_state": [L, H]))}``.

    With stored features the batch is ready for the draft's forward (``input_ids`` = next tokens,
    ``target_hidden_states``, ``loss_mask``), so a plain Trainer can train on it. Without them the batch carries
    ``tokens``, ``attention_mask`` and ``loss_mask`` for online features ([`PosSTrainer`] adds the features).
    """

    def __init__(self, pad_token_id: int = 0, max_length: int | None = None):
        self.pad_token_id = pad_token_id
        self.max_length = max_length

    def _pad(self, rows, value):
        length = max(r.shape[0] for r in rows)
        out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), value)
        for i, row in enumerate(rows):
            out[i, : row.shape[0]] = row
        return out

    def __call__(self, examples: list[dict]) -> dict:
        cut = slice(0, self.max_length)
        tokens = self._pad([torch.as_tensor(e["input_ids"])[cut].long() for e in examples], self.pad_token_id)
        assistant = self._pad([torch.as_tensor(e["assistant_mask"])[cut].long() for e in examples], 0)
        attention = self._pad([torch.ones(len(torch.as_tensor(e["input_ids"])[cut]), dtype=torch.long) for e in examples], 0)
        loss_mask = pair_loss_mask(assistant) * attention
        if "hidden_states" in examples[0]:
            features = self._pad([torch.as_tensor(e["hidden_states"])[cut] for e in examples], 0)
            last = None
            if "last_hidden_state" in examples[0]:
                last = self._pad([torch.as_tensor(e["last_hidden_state"])[cut] for e in examples], 0)
            return draft_inputs(tokens, loss_mask, features, self.pad_token_id, last)
        return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask}
