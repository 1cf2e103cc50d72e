"""Checkpoints a kill cannot leave half-written, and resuming only from complete ones.

[`AtomicCheckpointMixin`] makes a Trainer write each checkpoint into a staging folder
(``output_dir/.staging/checkpoint-N``) and rename it to ``output_dir/checkpoint-N`` once every file is written, so
a ``checkpoint-N`` folder is always complete (single-process runs; with several processes, each of which writes its
own files into the checkpoint, or with ``push_to_hub``, the Trainer's own in-place save is kept).

The Trainer writes a checkpoint's files one after the other, the trainer state (``trainer_state.json``) last. A
checkpoint written in place and cut off by a kill has no readable trainer state or a cut-off weights file:
[`last_complete_checkpoint`] skips such a folder (renaming it ``incomplete-checkpoint-N``, so neither resuming nor
the Trainer's checkpoint rotation picks it up again) and returns the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings

from .._transformers_compat import check_trainer

check_trainer()

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin")


def checkpoint_problem(folder: str) -> str | None:
    """Why ``folder`` is not a complete checkpoint (None when it is)."""
    state_path = os.path.join(folder, "trainer_state.json")
    try:
        with open(state_path, encoding="utf-8") as handle:
            state = json.load(handle)
    except FileNotFoundError:
        return "no trainer_state.json (the save was interrupted)"
    except (OSError, ValueError) as error:
        return f"trainer_state.json is unreadable ({error})"
    if not isinstance(state, dict) or "global_step" not in state:
        return "trainer_state.json holds no global_step"
    weights = [os.path.join(folder, name) for name in WEIGHT_FILES if os.path.isfile(os.path.join(folder, name))]
    if not weights:
        return "no weights file"
    if weights[0].endswith(".safetensors"):
        from ..checkpoints.loading import safetensors_keys

        try:
            safetensors_keys(weights[0])
        except ValueError as error:
            return str(error)
    return None


def last_complete_checkpoint(output_dir, quarantine: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir`` (None when there is none).

    Incomplete ones newer than it are reported with a warning and, with ``quarantine``, renamed to
    ``incomplete-checkpoint-N`` next to it (kept for inspection, ignored from then on).
    """
    if not os.path.isdir(output_dir):
        return None
    found = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))
                    and os.path.isdir(os.path.join(output_dir, name))), reverse=True)
    for _, name in found:
        folder = os.path.join(output_dir, name)
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        aside = os.path.join(output_dir, f"incomplete-{name}")
        message = f"{folder} is incomplete ({problem}); resuming from an earlier checkpoint instead."
        main_process = int(os.environ.get("RANK", "0")) == 0  # under DDP only rank 0 moves it
        if quarantine and main_process and not os.path.exists(aside):
            try:
                os.replace(folder, aside)
                message += f" It was moved to {aside}."
            except OSError:
                pass
        warnings.warn(message, stacklevel=2)
    return None


STAGING = ".staging"


class AtomicCheckpointMixin:
    """Mixin for a `transformers.Trainer`: checkpoints appear under their final name only once complete."""

    def _atomic_saves(self, trial) -> bool:
        args = self.args
        return trial is None and args.world_size == 1 and not args.push_to_hub and args.should_save

    def _get_output_dir(self, trial):
        output_dir = super()._get_output_dir(trial)
        staging = getattr(self, "_poss_staging", None)
        return staging if staging is not None else output_dir

    def _save_checkpoint(self, model, trial):
        if not self._atomic_saves(trial):
            return super()._save_checkpoint(model, trial)
        run_dir = super()._get_output_dir(trial)
        staging = os.path.join(run_dir, STAGING)
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
        os.makedirs(staging)
        name = f"checkpoint-{self.state.global_step}"
        best_before = self.state.best_model_checkpoint
        self._poss_staging = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._poss_staging = None
        staged, final = os.path.join(staging, name), os.path.join(run_dir, name)
        if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging):
            self.state.best_model_checkpoint = final
            self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
        elif best_before and self.state.best_model_checkpoint != best_before:
            self.state.best_model_checkpoint = best_before  # an older best lives in run_dir, not in staging
            self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staged, final)
        shutil.rmtree(staging, ignore_errors=True)
        from transformers.trainer_utils import rotate_checkpoints

        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
