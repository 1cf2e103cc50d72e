"""Schedules sized to a time budget: time a few training batches, then choose the steps that fit.

A cosine (or linear) schedule that is cut by a wall-time limit ends with its learning rate still high; choosing
``max_steps`` from the measured step time up front lets the schedule run to its end within the budget.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

__all__ = ["steps_for_budget", "time_training_steps", "timing_batches", "load_schedule", "save_schedule",
           "SCHEDULE_FILE"]

SCHEDULE_FILE = "schedule.json"


def steps_for_budget(seconds_per_step: float, budget_minutes: float, steps_per_epoch: int,
                     max_epochs: float | None = None, margin: float = 0.05) -> int:
    """Optimiser steps that fit ``budget_minutes`` at ``seconds_per_step`` (``margin`` kept for logging, saving and
    evaluation), at most ``max_epochs`` epochs of ``steps_per_epoch`` steps, and at least one step."""
    if seconds_per_step <= 0 or not math.isfinite(seconds_per_step):
        raise ValueError(f"seconds_per_step must be a positive number, got {seconds_per_step}.")
    if budget_minutes <= 0:
        raise ValueError(f"budget_minutes must be > 0, got {budget_minutes}.")
    steps = int(budget_minutes * 60.0 * (1.0 - margin) / seconds_per_step)
    if max_epochs is not None and max_epochs > 0 and steps_per_epoch > 0:
        steps = min(steps, int(math.ceil(max_epochs * steps_per_epoch)))
    return max(1, steps)


def time_training_steps(step, batches, warmup: int = 1) -> float:
    """Mean seconds of ``step(batch)`` over ``batches[warmup:]`` (RNG state left unchanged), after one untimed call
    on every batch: the allocator then holds what the largest batch needs, as it does in training (with malloc
    keeping freed memory, a first call on a larger batch pays its page faults; timed, they made a 4-minute schedule
    end after 63% of its budget)."""
    batches = list(batches)
    if len(batches) <= warmup:
        raise ValueError(f"need more than {warmup} batches to time training steps, got {len(batches)}.")
    with torch.random.fork_rng(devices=[]):
        for batch in batches:
            step(batch)
        start = time.perf_counter()
        for batch in batches[warmup:]:
            step(batch)
        return (time.perf_counter() - start) / (len(batches) - warmup)


def timing_batches(lengths, order, batch_size: int, count: int = 4, max_length: int | None = None,
                   warmup: int = 1) -> tuple[list[list[int]], float]:
    """``count`` batches of dataset indices to time training steps on, drawn at random from the quarter of an epoch's
    batches whose padded size is nearest its mean (some twice if it has fewer), and the factor from the padded size
    of the timed ones (all but the first ``warmup``) to an epoch's mean.

    The first batches of an epoch can be far from its mean (length-grouped batches start with the longest
    sequences), so a schedule sized on them would end well before its budget; batches of any size drawn at random
    give a factor anywhere from 0.7 to 1.8 (27,000 conversations, three timed batches of 8), which also scales a
    step's fixed cost. A batch's padded size is its rows times its longest sequence (at most ``max_length``), which
    the step time follows.

    Args:
        lengths: tokens of every sequence of the dataset.
        order: the sampler's indices for one epoch.
    """
    cap = max_length or math.inf
    batches = [list(order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
    sizes = [len(b) * min(cap, max(lengths[i] for i in b)) for b in batches]
    mean = sum(sizes) / len(sizes)
    pool = sorted(range(len(batches)), key=lambda j: abs(sizes[j] - mean))[: max(count, len(batches) // 4)]
    shuffled = [pool[i] for i in torch.randperm(len(pool)).tolist()]
    picked = [shuffled[i % len(shuffled)] for i in range(max(count, warmup + 1))]  # an epoch of few batches: again
    timed = [sizes[j] for j in picked[warmup:]]
    return [batches[j] for j in picked], mean / (sum(timed) / len(timed))


def load_schedule(output_dir, budget_minutes: float) -> dict | None:
    """The schedule chosen earlier for the same budget in ``output_dir``, if any (a resumed run keeps it)."""
    path = Path(output_dir) / SCHEDULE_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("budget_minutes") != budget_minutes:
        return None
    if not isinstance(record.get("max_steps"), int) or record["max_steps"] < 1:
        return None
    return record


def save_schedule(output_dir, record: dict) -> None:
    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{SCHEDULE_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    tmp.replace(path / SCHEDULE_FILE)
