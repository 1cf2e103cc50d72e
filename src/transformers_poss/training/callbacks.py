"""Trainer callbacks and the held-out evaluation of a draft, for `PosSTrainer` or any `transformers.Trainer`.

- `ClipGradValueCallback`: gradients clipped by value (the authors' recipe);
- `TimeLimitCallback`: a wall-time cap on a run;
- `PositionAccuracyCallback`: position-wise accuracy and acceptance on held-out conversations (`evaluate_draft`).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from transformers import TrainerCallback

from .feature_inputs import TargetFeatures, batch_to, draft_feature_layers, with_target_features

__all__ = ["ClipGradValueCallback", "TimeLimitCallback", "PositionAccuracyCallback", "evaluate_draft", "unwrap_draft"]


class ClipGradValueCallback(TrainerCallback):
    """Clips every gradient entry to ``[-max_value, max_value]`` after accumulation, before the optimiser step."""

    def __init__(self, max_value: float):
        self.max_value = max_value

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        torch.nn.utils.clip_grad_value_([p for p in model.parameters() if p.grad is not None], self.max_value)


class TimeLimitCallback(TrainerCallback):
    """Stops training once ``minutes`` of wall time have passed since ``on_train_begin`` (checked after each step)."""

    def __init__(self, minutes: float):
        self.seconds = 60.0 * minutes
        self.start = None
        self.stopped_at_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None and time.monotonic() - self.start >= self.seconds:
            control.should_training_stop = True
            self.stopped_at_step = state.global_step


class PositionAccuracyCallback(TrainerCallback):
    """Position-wise accuracy of the draft on held-out conversations, for any Trainer.

    Every ``every_steps`` optimiser steps (and at every evaluation) the draft runs over ``eval_batches`` (collated
    batches, with stored features or with ``target`` for online features); the figures of [`evaluate_draft`] are
    added to ``state.log_history`` as ``{prefix}_acc_d`` / ``{prefix}_accept_d`` / ``{prefix}_chain_tau``.
    """

    def __init__(self, eval_batches, target=None, every_steps: int | None = None, prefix: str = "heldout",
                 pad_token_id: int = 0):
        self.batches = list(eval_batches)
        self.target = target
        self.features = None  # TargetFeatures for the layers the draft reads, made on first use
        self.every_steps, self.prefix, self.pad_token_id = every_steps, prefix, pad_token_id
        self.history: list[dict] = []

    def _with_features(self, batch):
        return with_target_features(batch, self.features, self.pad_token_id,
                                    "Held-out batches without stored features need `target=`.")

    def _run(self, state, model):
        device = next(model.parameters()).device
        if self.features is None and self.target is not None:
            self.features = TargetFeatures(self.target, draft_feature_layers(unwrap_draft(model)))
        metrics = evaluate_draft(model, self.batches, lambda b: batch_to(b, device), self._with_features)
        record = {f"{self.prefix}_{k}": v for k, v in metrics.items()} | {"step": state.global_step}
        self.history.append(record)
        state.log_history.append(record)
        return record

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_steps and state.global_step % self.every_steps == 0:
            self._run(state, model)

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        record = self._run(state, model)
        if metrics is not None:
            metrics.update({k: v for k, v in record.items() if k != "step"})


def unwrap_draft(model):
    """The `PosSDraftModel` inside a PeftModel / DDP wrapper."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module"):
            model = model.module
        else:
            return model


@torch.no_grad()
def evaluate_draft(model, batches, prepare=lambda b: b, with_features=lambda b: b, accelerator=None) -> dict:
    """Aggregate the objective's metrics over ``batches`` (summed over processes when ``accelerator`` is given)."""
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    for batch in batches:
        out = model(**with_features(prepare(batch)))
        sums["loss"] += float(out.loss)
        sums["batches"] += 1
        for key, value in out.metrics.items():
            if key.startswith(("correct_", "count_", "chain_")):
                sums[key] += float(value)
    model.train(was_training)
    keys = sorted(sums)
    totals = torch.stack([sums[k] for k in keys])
    if accelerator is not None and accelerator.num_processes > 1:
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    sums = dict(zip(keys, totals.tolist()))
    metrics = {"loss": sums["loss"] / max(sums["batches"], 1)}
    depth, tau, reach = 1, 1.0, 1.0
    while f"count_{depth}" in sums:
        metrics[f"acc_{depth}"] = sums[f"correct_{depth}"] / max(sums[f"count_{depth}"], 1)
        accept = sums[f"chain_accepted_{depth}"] / max(sums[f"chain_reached_{depth}"], 1)
        metrics[f"accept_{depth}"] = accept
        reach *= accept
        tau += reach
        depth += 1
    metrics["chain_tau"] = tau
    return metrics
