"""Output classes of the PosS draft (shared by the model and the training objective)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import ModelOutput

from .speculation.draft_cache import PosSDraftCache


@dataclass
class PosSDraftOutput(ModelOutput):
    """Output of [`PosSDraftModel.forward`].

    Args:
        last_hidden_state (`[B, T, H]`): predicted features f^_{t+1}.
        cache ([`PosSDraftCache`], *optional*): updated cache when one was passed.
        loss (*optional*): training loss when training inputs were given.
        metrics (*optional*): per-step accuracies and losses (training only).
    """

    loss: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    cache: PosSDraftCache | None = None
    metrics: dict | None = None
