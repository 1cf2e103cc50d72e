"""`PosSTrainer` / `PosSTrainingArguments`: the transformers Trainer plus what drafts need.

A plain `transformers.Trainer` already trains a draft on offline features (the draft's forward returns the loss; set
``remove_unused_columns=False``). `PosSTrainer` adds:

- online features: the frozen target (a causal LM or a `peft.PeftModel`) runs inside the training step;
- the objective settings (loss weights, noise, unrolled steps) as training arguments;
- gradient clipping by value (the authors' recipe) and layer checkpointing of the unrolled steps;
- evaluation of position-wise accuracy and acceptance (draft depth 1..K along the target's own continuation);
- DDP with specialists that a run never uses (``ddp_find_unused_parameters`` set accordingly);
- per-depth training accuracies in the logs.
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.utils import logging

from .callbacks import ClipGradValueCallback, PositionAccuracyCallback, TimeLimitCallback, evaluate_draft, unwrap_draft
from .checkpoints import AtomicCheckpointMixin
from .feature_inputs import (PosSDataCollator, TargetFeatures, check_feature_layout, draft_feature_layers,
                             with_target_features)
from .memory import keep_freed_memory
from .objective import OBJECTIVE_FIELDS, ObjectiveConfig, ObjectiveFields, check_objective, set_objective
from .precision import bf16_pays
from .warm_start import init_specialists

logger = logging.get_logger(__name__)

__all__ = [
    "PosSTrainingArguments",
    "PosSTrainer",
    "ClipGradValueCallback",
    "TimeLimitCallback",
    "PositionAccuracyCallback",
    "evaluate_draft",
    "init_specialists",
    "unwrap_draft",
]


@dataclass
class PosSTrainingArguments(ObjectiveFields, TrainingArguments):
    r"""[`TrainingArguments`] with the draft objective's settings (the fields of [`ObjectiveFields`], defined there
    once) and the PosS authors' optimiser defaults (AdamW lr 3e-5, betas (0.9, 0.95), 1% linear warmup then linear
    decay, gradient clipping by value 0.5). ``bf16`` left unset turns bf16 autocast on where it measures faster
    (see [`precision`]); the soft labels and the softmax of the loss stay float32 either way.

    Args:
        num_unrolled_steps, feature_weight, ce_weight, topk_weight, topk, noise, noise_scale, step_weights,
            step_weight_decay, attention_chunk_size: the objective (see [`ObjectiveConfig`]; EAGLE-3's:
            ``feature_weight=0, ce_weight=1, step_weight_decay=0.8``).
        max_length (`int`): tokens per sequence (longer ones are truncated by the collator).
        max_grad_value (`float`, *optional*): clip every gradient entry to [-v, v] before the optimiser step.
        fc_learning_rate_scale (`float`): learning rate of the shared ``fc`` relative to the rest (1.0); ``0`` freezes
            it. In a multi-step draft the later steps give most of ``fc``'s gradient; a draft started from a trained
            EAGLE layer keeps its step-1 behaviour better with a slower or frozen ``fc``.
        feature_fc_learning_rate_scale (`float`): the same for ``feature_fc``, the fusion of a ``feature_layers``
            draft's target layers (1.0; new in a warm start from an EAGLE-2 draft, so it learns at the full rate).
        train_budget_minutes (`float`, *optional*): size the schedule to this much wall time: a few batches are timed
            before training and ``max_steps`` is set to the steps that fit (at most ``num_train_epochs`` epochs), so the
            learning-rate schedule always runs to its end. The choice is stored in ``output_dir/schedule.json`` and
            reused when a run resumes.
        train_sampling_strategy (`str`): ``"group_by_length"`` by default (transformers: ``"random"``): batches of
            sequences of similar lengths in a random order, so a batch pads to little more than its own lengths
            (the lengths come from the dataset's ``lengths`` where it has them).
        max_train_minutes (`float`, *optional*): hard wall-time limit of one `train()` call; when it is reached the
            run stops after the current step (the learning-rate schedule is cut short) and ``train()`` returns.
        keep_freed_memory (`bool`): at `train()`, let glibc's malloc keep freed memory for reuse (a process-wide
            setting, see [`memory.keep_freed_memory`]): training steps on CPUs stop paying page faults for their
            large tensors (1.07-1.26x faster for a one-step draft, 1.30-1.35x for PosS-2, measured on a 2-core CPU).
            On by default; off leaves the allocator alone.
    """

    max_length: int = field(default=2048, metadata={"help": "Maximum tokens per sequence."})
    max_grad_value: float | None = field(default=0.5, metadata={"help": "Clip gradients by value (None: off)."})
    fc_learning_rate_scale: float = field(
        default=1.0, metadata={"help": "Learning rate of the shared fc relative to the rest (0: frozen)."}
    )
    feature_fc_learning_rate_scale: float = field(
        default=1.0, metadata={"help": "Learning rate of feature_fc (feature_layers drafts) relative to the rest."}
    )
    train_budget_minutes: float | None = field(
        default=None, metadata={"help": "Choose max_steps so the whole schedule fits this many minutes (None: off)."}
    )
    max_train_minutes: float | None = field(
        default=None, metadata={"help": "Stop training (and save) after this many minutes of wall time (None: off)."}
    )
    keep_freed_memory: bool = field(
        default=True, metadata={"help": "At train(), let malloc keep freed memory for reuse (process-wide; fewer page "
                                        "faults per step on CPUs)."}
    )
    learning_rate: float = field(default=3e-5, metadata={"help": "AdamW learning rate."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    warmup_steps: float = field(default=0.01, metadata={"help": "Warmup steps, or a ratio of all steps if < 1."})
    max_grad_norm: float = field(default=0.0, metadata={"help": "Clip by norm (0: off; clipping is by value)."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the draft's training inputs."})
    train_sampling_strategy: str = field(
        default="group_by_length",
        metadata={"help": "Sampler: 'group_by_length' (default: batches of similar lengths, little padding), 'random', "
                          "'sequential' or 'batch_rebalance'.",
                  "choices": ["random", "sequential", "group_by_length", "batch_rebalance"]},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision (autocast; weights stay float32). Unset: on where it measures faster "
                          "(CPUs with bf16 units, GPUs that support it), off elsewhere and with fp16."},
    )

    def objective(self) -> ObjectiveConfig:
        values = {name: getattr(self, name) for name in OBJECTIVE_FIELDS}
        if values["step_weights"] is not None:
            values["step_weights"] = list(values["step_weights"])
        return ObjectiveConfig(**values)

    def __post_init__(self):
        if self.ddp_backend is None and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
            self.ddp_backend = "gloo"  # DDP on CPUs
        if self.bf16 is None:
            on_gpu = torch.cuda.is_available() and not self.use_cpu
            self.bf16, why = (False, "fp16 is set") if self.fp16 else bf16_pays("cuda" if on_gpu else "cpu")
            # logged when a PosSTrainer starts (after every argument check)
            self.precision_choice = f"bf16 mixed precision: {'on' if self.bf16 else 'off'} ({why})"
            if self.bf16 and not on_gpu:
                self.use_cpu = True  # transformers accepts bf16 without a GPU only with use_cpu (no GPU here anyway)
        TrainingArguments.__post_init__(self)
        check_objective(self)
        if self.fc_learning_rate_scale < 0:
            raise ValueError(f"fc_learning_rate_scale must be >= 0 (0 freezes fc), got {self.fc_learning_rate_scale}.")
        if self.feature_fc_learning_rate_scale < 0:
            raise ValueError("feature_fc_learning_rate_scale must be >= 0 (0 freezes feature_fc), got "
                             f"{self.feature_fc_learning_rate_scale}.")
        if self.train_budget_minutes is not None and self.train_budget_minutes <= 0:
            raise ValueError(f"train_budget_minutes must be > 0, got {self.train_budget_minutes}.")


class PosSTrainer(AtomicCheckpointMixin, Trainer):
    """Trainer for PosS drafts.

    Args:
        model: a [`PosSDraftModel`] (or a PeftModel around one).
        args ([`PosSTrainingArguments`]).
        target (*optional*): the target model; needed for online features (batches without stored features) and
            attached to the draft when it is not attached yet.
        Other arguments as for [`Trainer`]. The default collator is [`PosSDataCollator`].
    """

    def __init__(self, model=None, args: PosSTrainingArguments | None = None, target=None, data_collator=None,
                 processing_class=None, callbacks=None, **kwargs):
        args = args or PosSTrainingArguments(output_dir="poss-draft")
        draft = unwrap_draft(model)
        if getattr(args, "precision_choice", None):
            logger.info(args.precision_choice)
        if target is not None:
            if not draft.is_attached:
                draft.attach_target(target)
            self.target_features = TargetFeatures(target, draft_feature_layers(draft))
        else:
            self.target_features = None
        for name in ("train_dataset", "eval_dataset"):  # stored features must be the ones the draft reads
            dataset = kwargs.get(name)
            if hasattr(dataset, "feature_layers") and hasattr(dataset, "directory"):
                check_feature_layout(dataset.feature_layers, draft, f"the features in {dataset.directory}")
        objective = args.objective() if hasattr(args, "objective") else ObjectiveConfig()
        set_objective(draft, objective)
        for module, scale in self._scaled_modules(draft, args):
            if scale == 0:
                module.requires_grad_(False)
        self._configure_checkpointing(draft, args)
        self._configure_ddp(draft, args, objective)
        pad = getattr(processing_class, "pad_token_id", None) or draft.config.pad_token_id or 0
        self.pad_token_id = pad
        data_collator = data_collator or PosSDataCollator(pad, getattr(args, "max_length", None))
        callbacks = list(callbacks or [])
        if getattr(args, "max_grad_value", None):
            callbacks.append(ClipGradValueCallback(args.max_grad_value))
        if getattr(args, "max_train_minutes", None):
            callbacks.append(TimeLimitCallback(args.max_train_minutes))
        super().__init__(model=model, args=args, data_collator=data_collator, processing_class=processing_class,
                         callbacks=callbacks, **kwargs)
        if target is not None and next(target.parameters()).device != self.args.device:
            target.to(self.args.device)
        self._train_metrics = defaultdict(list)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _configure_checkpointing(draft, args):
        """Checkpoint each unrolled step's layer call (the Trainer's own switch does not apply to draft layers)."""
        wanted = bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False))
        object.__setattr__(draft, "_poss_checkpoint_layers", wanted)
        for name in ("gradient_checkpointing", "activation_checkpointing"):
            if getattr(args, name, False):
                setattr(args, name, False)

    @staticmethod
    def _configure_ddp(draft, args, objective):
        """DDP must look for unused parameters when some specialist is never run by the unrolled steps."""
        if args.ddp_find_unused_parameters is not None:
            return
        steps = objective.num_unrolled_steps or draft.config.training_depth
        used = {draft.config.specialist_for_step(k) for k in range(steps)}
        args.ddp_find_unused_parameters = len(used) < draft.config.num_specialists

    # ------------------------------------------------------------------ optimiser and schedule
    @staticmethod
    def _scaled_modules(draft, args) -> list:
        """``(module, learning-rate scale)`` of the shared ``fc`` and, when the draft has one, ``feature_fc``."""
        pairs = [("fc", "fc_learning_rate_scale"), ("feature_fc", "feature_fc_learning_rate_scale")]
        return [(getattr(draft, name), getattr(args, scale, 1.0)) for name, scale in pairs
                if getattr(draft, name, None) is not None]

    def create_optimizer(self, model=None):
        """The Trainer's optimiser, with the shared ``fc`` (and ``feature_fc``) in groups of their own at
        ``fc_learning_rate_scale`` (``feature_fc_learning_rate_scale``) x lr."""
        optimizer = super().create_optimizer(model)
        for module, scale in self._scaled_modules(unwrap_draft(self.model), self.args):
            if scale in (0, 1.0):
                continue
            chosen = {id(p) for p in module.parameters()}
            for group in list(optimizer.param_groups):
                slow = [p for p in group["params"] if id(p) in chosen]
                if not slow:
                    continue
                group["params"] = [p for p in group["params"] if id(p) not in chosen]
                optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": slow,
                                           "lr": group["lr"] * scale})
        optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        return optimizer

    def _budget_steps(self) -> int:
        """``max_steps`` for ``train_budget_minutes`` (timed on a few training batches; stored for resumed runs)."""
        from .schedule import load_schedule, save_schedule, steps_for_budget, time_training_steps, timing_batches

        budget = self.args.train_budget_minutes
        record = load_schedule(self.args.output_dir, budget)
        if record is None:
            loader = self.get_train_dataloader()
            steps_per_epoch = max(1, len(loader) // max(1, self.args.gradient_accumulation_steps))
            lengths, scale = getattr(self.train_dataset, "lengths", None), 1.0
            if lengths is not None:  # batches drawn from the whole epoch, and its mean padded size
                with torch.random.fork_rng(devices=[]):
                    chosen, scale = timing_batches(lengths, list(self._get_train_sampler()),
                                                   self.args.train_batch_size,
                                                   max_length=getattr(self.args, "max_length", None))
                batches = [self.data_collator([self.train_dataset[i] for i in b]) for b in chosen]
            else:
                batches = list(itertools.islice(loader, 4))
            model = self.model.to(self.args.device)
            model.train()

            def step(batch):  # under the mixed precision of training (accelerate applies it to the prepared model)
                with self.accelerator.autocast():
                    loss = self.compute_loss(model, self._prepare_inputs(batch))
                loss.backward()
                model.zero_grad(set_to_none=True)

            seconds = time_training_steps(step, batches) * scale * self.args.gradient_accumulation_steps
            self._train_metrics.clear()
            seconds = self._agree_across_processes(seconds)
            steps = steps_for_budget(seconds, budget, steps_per_epoch, self.args.num_train_epochs)
            record = {"budget_minutes": budget, "seconds_per_step": seconds, "steps_per_epoch": steps_per_epoch,
                      "max_steps": steps, "epochs": steps / steps_per_epoch}
            if self.args.should_save:
                save_schedule(self.args.output_dir, record)
        logger.info("train_budget_minutes=%s: %d steps (%.2f epochs at %.2f s/step)", budget, record["max_steps"],
                    record["epochs"], record["seconds_per_step"])
        self.budget_schedule = record
        return record["max_steps"]

    def _agree_across_processes(self, seconds: float) -> float:
        """The slowest process's step time, so every process chooses the same number of steps."""
        if self.accelerator.num_processes <= 1:
            return seconds
        value = torch.tensor([seconds], device=self.accelerator.device)
        return float(self.accelerator.reduce(value, reduction="max"))

    def _get_train_sampler(self, train_dataset=None):
        """transformers' sampler, except that ``train_sampling_strategy="group_by_length"`` (the default here) takes
        the lengths a dataset knows (``dataset.lengths``: `FeatureShardDataset` reads them from its shards' offsets)
        instead of loading every item, features included, to measure it."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        lengths = getattr(dataset, "lengths", None)
        if self.args.train_sampling_strategy != "group_by_length" or lengths is None:
            return super()._get_train_sampler(train_dataset)
        return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                    lengths=list(lengths))

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        if getattr(self.args, "keep_freed_memory", False):
            keep_freed_memory()
        if getattr(self.args, "train_budget_minutes", None) and self.args.max_steps <= 0:
            self.args.max_steps = self._budget_steps()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    # ------------------------------------------------------------------ loss
    def _with_features(self, inputs: dict) -> dict:
        """Add target features to a token batch (online); batches with stored features pass through."""
        return with_target_features(inputs, self.target_features, self.pad_token_id,
                                    "This batch has no stored features: pass `target=` to PosSTrainer for online "
                                    "features.")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**self._with_features(inputs))
        if model.training:
            for key, value in outputs.metrics.items():
                if key.startswith("acc_") or key.startswith("loss_"):
                    self._train_metrics[key].append(float(value))
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def log(self, logs: dict, start_time=None) -> None:
        if "loss" in logs and self._train_metrics:
            logs.update({k: sum(v) / len(v) for k, v in self._train_metrics.items()})
            self._train_metrics.clear()
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Loss, per-depth top-1 accuracy and position-wise acceptance on the held-out set.

        Logged per draft depth d: ``{prefix}_acc_{d}`` (agreement with the target's top-1 given the target's own
        continuation as ancestors), ``{prefix}_accept_{d}`` (the same given depths 1..d-1 were right: the greedy
        position-wise acceptance rate of a chain) and ``{prefix}_chain_tau`` (expected tokens per target forward of
        a depth-K chain, bonus token included).
        """
        dataloader = self.get_eval_dataloader(eval_dataset)
        metrics = evaluate_draft(self.model, dataloader, self._prepare_inputs, self._with_features, self.accelerator)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
