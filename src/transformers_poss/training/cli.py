"""`poss train`: data (optionally self-distilled), target features, training and a saved draft, from one config.

    poss train --config recipe.yaml [--learning_rate 1e-3 --num_specialists 2 ...]
    torchrun --nproc_per_node 2 -m transformers_poss train --config recipe.yaml      # one DDP job

The settings are the fields of [`transformers_poss.training.config`] (`poss train --help` lists them all, with their
defaults); a recipe holds them flat or by section:

    target: smollm2-135m-instruct       # embedded name, Hub id or folder
    stage: all                          # data | features | train | all (each stage resumes where it stopped)
    draft: {num_specialists: 3, positions_per_specialist: 2, init_from: null, draft_vocab_size: null,
            feature_layers: null}     # e.g. [2, 15, 27]: an EAGLE-3-style draft reading three target layers
    data:
      train: [conversations.jsonl]      # ShareGPT / OpenAI JSON(L) files or dataset names
      prompts: [prompts.jsonl]          # {"prompt": ...} lines to answer with the target
      synthesize_prompts: 0             # sample this many prompts from the target itself
      self_distill: false               # regenerate the assistant turns of `train` with the target
      generation: {batch_size: 16, max_new_tokens: 512, temperature: 0.0, int8: false}
      eval_fraction: 0.02
      max_length: 2048                  # = training.max_length
    features: offline                   # offline (bf16 shards, computed once) or online
    features_dir: null                  # default output_dir/features
    device: auto                        # where the target runs (auto: this process's GPU when present)
    training: {...}                     # any PosSTrainingArguments field (output_dir and seed included)

Under torchrun / accelerate launch every process runs the same command: the main process builds the data and the
features first (the others then find them done), training is one DDP job (gloo on CPU, NCCL on GPUs), and only the
main process writes the final draft.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import yaml
from transformers.utils import logging

from ..cli.errors import log_to_stderr
from .config import PosSTrainConfig, build_parser, parse_train_args


logger = logging.get_logger(__name__)


def main(argv: list[str]) -> int:
    """``poss train ARGS``: parse with the schema, then run (``--help`` shows every field)."""
    log_to_stderr("train")  # progress through the package's logger (TRANSFORMERS_VERBOSITY, default info)
    config = parse_train_args(argv)
    if config.script.dry_run:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False))
        return 0
    try:
        status = run(config)
        _wait_for_every_rank()
        return status
    except KeyboardInterrupt:
        logger.warning("interrupted; kept: %s. Run the same command again to resume from there.", kept_work(config))
        raise
    finally:
        _end_process_group()


def kept_work(config: PosSTrainConfig) -> str:
    """What a stopped run leaves behind, in words: the generated data files and the newest complete checkpoint."""
    from .checkpoints import last_complete_checkpoint
    from .distill import read_jsonl

    kept = []
    out_dir = Path(config.data.distill_dir or Path(config.training.output_dir) / "data")
    for name in ("prompts.jsonl", "conversations.jsonl"):
        path = out_dir / name
        if path.is_file():
            kept.append(f"{len(read_jsonl(path))} line(s) in {path}")
    features = Path(config.script.features_dir or Path(config.training.output_dir) / "features")
    if features.is_dir():
        kept.append(f"{sum(1 for _ in features.rglob('*.safetensors'))} feature shard(s) in {features}")
    output_dir = config.training.output_dir
    checkpoint = last_complete_checkpoint(output_dir, quarantine=False) if output_dir and os.path.isdir(output_dir) \
        else None
    kept.append(f"checkpoint {checkpoint}" if checkpoint else "no complete checkpoint yet")
    return "; ".join(kept)


def _wait_for_every_rank() -> None:
    """Under torchrun / accelerate: the ranks leave together once the job is done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _end_process_group() -> None:
    """Tear a process group down before the interpreter exits (gloo's threads left running at exit abort a rank after
    the job is done)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- stages
def _split(conversations, config: PosSTrainConfig):
    """(train, held-out) conversations; ``max_conversations`` keeps a prefix of the training ones."""
    data = config.data
    if data.eval:
        from .data import load_conversations

        train, held = list(conversations), load_conversations(data.eval)
    else:
        shuffled = list(conversations)
        random.Random(config.training.seed).shuffle(shuffled)
        count = int(round(len(shuffled) * data.eval_fraction)) if len(shuffled) > 1 else 0
        train, held = shuffled[count:], shuffled[:count]
    if data.max_conversations:  # a prefix of the same order: its feature shards are the full set's first ones
        train = train[: data.max_conversations]
    return train, held


def build_conversations(config: PosSTrainConfig, target, tokenizer) -> list[list[dict]]:
    """The training conversations: given ones, and/or prompts answered by the target (resumable files)."""
    from .data import load_conversations
    from .distill import int8_copy, read_jsonl, regenerate, synthesize_prompts

    data, seed = config.data, config.training.seed
    made = {}

    def generator():  # the model that generates; an int8 copy is made once, only when something is generated
        if "model" not in made:
            made["model"] = int8_copy(target) if data.generation_int8 else target
        return made["model"]

    out_dir = Path(data.distill_dir or Path(config.training.output_dir) / "data")
    given = [c for source in data.train for c in load_conversations(source)]
    prompts = [r["prompt"] for path in data.prompts for r in read_jsonl(path)]
    if data.synthesize_prompts:
        out_dir.mkdir(parents=True, exist_ok=True)
        prompts += synthesize_prompts(generator(), tokenizer, data.synthesize_prompts, out_dir / "prompts.jsonl",
                                      batch_size=data.prompt_batch_size, max_new_tokens=data.prompt_max_new_tokens,
                                      seed=seed)
    to_answer = ([[m for m in c if m["role"] != "assistant"] for c in given] if data.self_distill else []) + prompts
    conversations = [] if data.self_distill else given
    if to_answer:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "conversations.jsonl"
        regenerate(generator(), tokenizer, to_answer, path, batch_size=data.generation_batch_size,
                   max_new_tokens=data.generation_max_new_tokens, temperature=data.generation_temperature, seed=seed)
        conversations += [r["messages"] for r in sorted(read_jsonl(path), key=lambda r: r["id"])]
    if not conversations:
        raise SystemExit("no training data: give --train, --prompts or --synthesize_prompts")
    return conversations


def build_datasets(config: PosSTrainConfig, target, tokenizer, write: bool = True):
    """(train, eval) datasets: feature shards (offline) or tokenized conversations (online).

    ``write=False`` (the other processes of a DDP job, after the main one) only reads the shards written before.
    """
    import torch

    from .data import ConversationDataset
    from .features import FeatureShardDataset, write_feature_shards

    train, held = _split(build_conversations(config, target, tokenizer), config)
    max_length = config.training.max_length
    datasets = [ConversationDataset(train, tokenizer, max_length), ConversationDataset(held, tokenizer, max_length)]
    logger.info("train: %d conversations, %d tokens; eval: %d", len(datasets[0]), datasets[0].num_tokens,
                len(datasets[1]))
    script = config.script
    if script.features == "online" or script.stage == "data":
        return datasets
    root = Path(script.features_dir or Path(config.training.output_dir) / "features")
    dtype = getattr(torch, script.features_dtype)
    layers = config.draft.feature_layers or None
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    count = getattr(text, "num_hidden_layers", None)
    out = []
    for name, dataset in zip(("train", "eval"), datasets):
        if len(dataset):
            if write:
                write_feature_shards(target, dataset, root / name, dtype=dtype, batch_size=script.features_batch_size,
                                     feature_layers=layers, autocast=script.features_autocast)
            out.append(FeatureShardDataset(root / name, feature_layers=layers, num_hidden_layers=count))
        else:
            out.append(None)
    return out


def build_draft(config: PosSTrainConfig, target, train_dataset, tokenizer):
    """A new draft for ``target``: specialists (and fc) optionally initialised from a trained draft, whose reduced
    vocabulary map and draft-tree settings (``generation_config``'s ``tree_*``) are then kept; otherwise the map is
    built from the training data's assistant tokens.

    A ``feature_layers`` draft started from a single-feature draft is a warm start: its ``feature_fc`` is fitted on
    the first training features (``feature_fc_init: fit``) or set to the identity on the highest layer."""
    from ..configuration_poss import PosSDraftConfig
    from ..modeling_poss import PosSDraftModel
    from .recipe_checks import draft_shape_fields
    from .warm_start import (feature_pairs, fit_feature_fc, inherit_tree_settings, init_specialists, is_warm_start,
                             load_source)

    spec = config.draft
    draft_config = PosSDraftConfig.for_target(
        target.config, num_specialists=spec.num_specialists, positions_per_specialist=spec.positions_per_specialist,
        intermediate_size=spec.intermediate_size, name_or_path=config.script.target,
        **draft_shape_fields(spec),
    )
    draft = PosSDraftModel(draft_config)
    if spec.init_from:
        source = load_source(spec.init_from)
        warm = is_warm_start(draft, source)
        init_specialists(draft, source, feature_fc=spec.feature_fc_init)
        settings = inherit_tree_settings(draft, source)
        logger.info("draft-tree settings of %s kept: %s", spec.init_from, settings)
        if warm and spec.feature_fc_init == "fit":
            share = fit_feature_fc(draft, feature_pairs(train_dataset, draft, target))
            logger.info("warm start from %s: feature_fc fitted onto the post-norm feature (R^2 %.4f)", spec.init_from,
                        share)
    inherited = draft.draft_to_target is not None
    if inherited and spec.draft_vocab_size and spec.draft_vocab_size != draft.config.draft_vocab_size:
        raise SystemExit(f"--draft_vocab_size {spec.draft_vocab_size} differs from the vocabulary of --init_from "
                         f"({draft.config.draft_vocab_size} tokens), which is kept: drop the setting or set it to the "
                         "source's size.")
    if spec.draft_vocab_size and not inherited:
        from ..vocab import build_token_map, count_tokens, set_token_map, special_token_ids

        assistant = (item["input_ids"][item["assistant_mask"].bool()] for item in train_dataset)
        counts = count_tokens(assistant, draft_config.vocab_size)
        set_token_map(draft, build_token_map(counts, spec.draft_vocab_size, special_token_ids(tokenizer)))
    return draft.attach_target(target)


def _last_checkpoint(output_dir):
    from .checkpoints import last_complete_checkpoint

    return last_complete_checkpoint(output_dir)


def train(config: PosSTrainConfig, target, tokenizer, train_dataset, eval_dataset):
    """Train (resuming from the last checkpoint in output_dir) and save the draft to output_dir/final."""
    from .trainer import PosSTrainer

    args = config.training
    if eval_dataset is None or not len(eval_dataset):
        args.eval_strategy = "no"
    if resolve_device(config.script.device) == "cpu":
        args.dataloader_pin_memory = False  # pinned memory is for copies to a GPU: on a CPU torch only warns
    if os.environ.get("POSS_NO_PROGRESS") == "1":
        args.disable_tqdm = True  # `poss --no-progress`, or stderr is not a terminal
    draft = build_draft(config, target, train_dataset, tokenizer)
    trainer = PosSTrainer(model=draft, args=args, target=target, train_dataset=train_dataset,
                          eval_dataset=eval_dataset, processing_class=tokenizer)
    result = trainer.train(resume_from_checkpoint=_last_checkpoint(args.output_dir))
    metrics = trainer.evaluate() if eval_dataset is not None and len(eval_dataset) else {}
    if trainer.is_world_process_zero():
        recipe = config.to_dict()
        draft.model_card_extra = _card(recipe, result, metrics, len(train_dataset))
        draft.training_recipe = json.loads(json.dumps({"config": recipe, "eval": metrics}, default=str))
        final = Path(args.output_dir) / "final"
        draft.save_pretrained(final)  # the card's eval results and training_recipe.json come from training_recipe
        logger.info("draft saved to %s", final)
    return metrics


def _card(recipe: dict, result, metrics, num_sequences) -> str:
    from ..checkpoints.model_card import portable

    recipe = portable(recipe)  # the card is public: no local paths
    lines = ["## Training", "", f"- target: `{recipe['script']['target']}`; {num_sequences} training sequences; "
             f"features: {recipe['script']['features']}", f"- steps: {result.global_step}; final training loss: "
             f"{result.training_loss:.4f}", "", "Recipe (`poss train` settings):", "", "```yaml",
             yaml.safe_dump({k: v for k, v in recipe.items()}, sort_keys=False).strip(), "```"]
    if metrics:
        depths = sorted(int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("eval_acc_"))
        lines += ["", "Held-out position-wise figures (greedy chain along the target's continuation):", "",
                  "| depth | " + " | ".join(map(str, depths)) + " |", "|---|" + "---|" * len(depths),
                  "| top-1 accuracy | " + " | ".join(f"{metrics[f'eval_acc_{d}']:.3f}" for d in depths) + " |",
                  "| acceptance | " + " | ".join(f"{metrics[f'eval_accept_{d}']:.3f}" for d in depths) + " |",
                  "", f"Expected tokens per target forward of a depth-{len(depths)} chain: "
                  f"{metrics['eval_chain_tau']:.2f} (bonus token included)."]
    return "\n".join(lines)


def resolve_device(name: str | None) -> str:
    """``auto`` -> this process's GPU when one is visible (``cuda:LOCAL_RANK`` under torchrun), else ``cpu``; any
    other name is returned unchanged."""
    import torch

    if name in (None, "auto"):
        if not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return name


def run(config: PosSTrainConfig) -> int:
    from accelerate import PartialState
    from transformers import set_seed

    from ..targets.embedded import load_target

    from .memory import keep_freed_memory
    from .recipe_checks import check_draft_fits, check_recipe

    check_recipe(config)  # before any model loads
    if config.training.keep_freed_memory:  # data, features and training all allocate and free large tensors
        keep_freed_memory()
    state = PartialState()  # joins the process group under torchrun / accelerate launch (gloo on CPU)
    set_seed(config.training.seed)
    with state.main_process_first():  # the main process makes data and features; the others then find them
        target, tokenizer = load_target(config.script.target, device=resolve_device(config.script.device))
        check_draft_fits(config, target)  # before the data and feature stages
        train_dataset, eval_dataset = build_datasets(config, target, tokenizer, write=state.is_main_process)
    if config.script.stage in ("data", "features"):
        return 0
    train(config, target, tokenizer, train_dataset, eval_dataset)
    return 0
