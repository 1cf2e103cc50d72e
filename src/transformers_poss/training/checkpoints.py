"""Resuming only from complete checkpoints.

The Trainer writes a checkpoint's files one after the other, the trainer state (``trainer_state.json``) last. A run
killed while saving leaves a ``checkpoint-N`` folder without a readable trainer state or with a cut-off weights
file. [`last_complete_checkpoint`] skips such a folder (renaming it ``incomplete-checkpoint-N``, so neither resuming
nor the Trainer's checkpoint rotation picks it up again) and returns the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import warnings

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
        from ..loading_checks import safetensors_keys

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
        if quarantine and not os.path.exists(aside):
            os.replace(folder, aside)
            message += f" It was moved to {aside}."
        warnings.warn(message, stacklevel=2)
    return None
