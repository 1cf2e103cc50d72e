"""`poss train`: data (optionally self-distilled), target features, training and a saved draft, from one config.

    poss train --config recipe.yaml [--set training.max_steps=100 --set draft.num_specialists=2 ...]

Config (YAML or JSON; every key optional except ``target``):

    target: smollm2-135m-instruct       # embedded name, Hub id or folder
    output_dir: runs/poss2              # checkpoints; the final draft goes to output_dir/final
    stage: all                          # data | features | train | all (each stage resumes where it stopped)
    draft: {num_specialists: 3, positions_per_specialist: 2, init_from: null, draft_vocab_size: null}
    data:
      train: [conversations.jsonl]      # ShareGPT / OpenAI JSON(L) files or dataset names
      prompts: [prompts.jsonl]          # {"prompt": ...} lines to answer with the target
      synthesize_prompts: 0             # sample this many prompts from the target itself
      self_distill: false               # regenerate the assistant turns of `train` with the target
      distill_dir: null                 # where generated files go (default output_dir/data)
      generation: {batch_size: 16, max_new_tokens: 512, temperature: 0.0, int8: false}  # int8: CPU, 2x/step
      eval: null                        # held-out conversations; else eval_fraction of the data
      eval_fraction: 0.02
      max_length: 2048
    features: offline                   # offline (bf16 shards, computed once) or online
    features_dir: null                  # default output_dir/features
    features_batch_size: 8              # sequences per target forward when computing features
    device: auto                        # where the target generates and computes features (auto: cuda if present)
    training: {...}                     # any PosSTrainingArguments field
"""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import yaml

DEFAULTS = {
    "target": None,
    "output_dir": "poss-draft",
    "stage": "all",
    "seed": 0,
    "draft": {"num_specialists": 1, "positions_per_specialist": 1, "init_from": None, "draft_vocab_size": None,
              "intermediate_size": None},
    "data": {"train": [], "prompts": [], "synthesize_prompts": 0, "self_distill": False, "distill_dir": None,
             "generation": {"batch_size": 16, "max_new_tokens": 512, "temperature": 0.0, "prompt_batch_size": 32,
                            "prompt_max_new_tokens": 96, "int8": False},
             "eval": None, "eval_fraction": 0.02, "max_length": 2048},
    "features": "offline",
    "features_dir": None,
    "features_dtype": "bfloat16",
    "features_batch_size": 8,
    "device": "auto",
    "training": {"per_device_train_batch_size": 4, "num_train_epochs": 1, "logging_steps": 10, "save_steps": 500,
                 "eval_strategy": "no", "report_to": "none"},
}


def add_arguments(parser) -> None:
    import argparse

    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", help="YAML or JSON recipe (layout above)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config entry, e.g. training.max_steps=100 (VALUE is parsed as YAML)")
    parser.add_argument("--target", help="target model (embedded name, Hub id or folder)")
    parser.add_argument("--output-dir", help="output folder")
    parser.add_argument("--stage", choices=["data", "features", "train", "all"], help="run only this stage")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")


# ---------------------------------------------------------------------------------------------------- config
def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in (update or {}).items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _set(config: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = config
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def resolve_config(path: str | None = None, overrides=(), **flags) -> dict:
    """Defaults <- config file <- ``--set`` overrides <- explicit flags."""
    config = _merge(copy.deepcopy(DEFAULTS), {})  # a copy: overrides must not change DEFAULTS
    if path:
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle) if path.endswith(".json") else yaml.safe_load(handle)
        config = _merge(config, loaded or {})
    for item in overrides:
        if "=" not in item:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        _set(config, key.strip(), yaml.safe_load(value))
    for key, value in flags.items():
        if value is not None:
            config[key] = value
    if not config["target"]:
        raise SystemExit("a target is required (config `target:` or --target)")
    for key in ("train", "prompts"):
        if isinstance(config["data"][key], str):
            config["data"][key] = [config["data"][key]]
    return config


# ---------------------------------------------------------------------------------------------------- stages
def _split(conversations, config):
    data = config["data"]
    if data["eval"]:
        from .data import load_conversations

        return conversations, load_conversations(data["eval"])
    shuffled = list(conversations)
    random.Random(config["seed"]).shuffle(shuffled)
    held = int(round(len(shuffled) * data["eval_fraction"])) if len(shuffled) > 1 else 0
    return shuffled[held:], shuffled[:held]


def build_conversations(config, target, tokenizer) -> list[list[dict]]:
    """The training conversations: given ones, and/or prompts answered by the target (resumable files)."""
    from .data import load_conversations
    from .distill import int8_copy, read_jsonl, regenerate, synthesize_prompts

    data, gen = config["data"], config["data"]["generation"]
    made = {}

    def generator():  # the model that generates; an int8 copy is made once, only when something is generated
        if "model" not in made:
            made["model"] = int8_copy(target) if gen.get("int8") else target
        return made["model"]

    out_dir = Path(data["distill_dir"] or Path(config["output_dir"]) / "data")
    given = [c for source in data["train"] for c in load_conversations(source)]
    prompts = [r["prompt"] for path in data["prompts"] for r in read_jsonl(path)]
    if data["synthesize_prompts"]:
        out_dir.mkdir(parents=True, exist_ok=True)
        prompts += synthesize_prompts(generator(), tokenizer, data["synthesize_prompts"], out_dir / "prompts.jsonl",
                                      batch_size=gen["prompt_batch_size"], max_new_tokens=gen["prompt_max_new_tokens"],
                                      seed=config["seed"])
    to_answer = ([[m for m in c if m["role"] != "assistant"] for c in given] if data["self_distill"] else []) + prompts
    conversations = [] if data["self_distill"] else given
    if to_answer:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "conversations.jsonl"
        regenerate(generator(), tokenizer, to_answer, path, batch_size=gen["batch_size"],
                   max_new_tokens=gen["max_new_tokens"], temperature=gen["temperature"], seed=config["seed"])
        conversations += [r["messages"] for r in sorted(read_jsonl(path), key=lambda r: r["id"])]
    if not conversations:
        raise SystemExit("no training data: give data.train, data.prompts or data.synthesize_prompts")
    return conversations


def build_datasets(config, target, tokenizer):
    """(train, eval) datasets: feature shards (offline) or tokenized conversations (online)."""
    import torch

    from .data import ConversationDataset
    from .features import FeatureShardDataset, write_feature_shards

    train, held = _split(build_conversations(config, target, tokenizer), config)
    max_length = config["data"]["max_length"]
    datasets = [ConversationDataset(train, tokenizer, max_length), ConversationDataset(held, tokenizer, max_length)]
    print(f"train: {len(datasets[0])} conversations, {datasets[0].num_tokens} tokens; eval: {len(datasets[1])}")
    if config["features"] == "online" or config["stage"] == "data":
        return datasets
    root = Path(config["features_dir"] or Path(config["output_dir"]) / "features")
    dtype = getattr(torch, config["features_dtype"])
    out = []
    for name, dataset in zip(("train", "eval"), datasets):
        if len(dataset):
            write_feature_shards(target, dataset, root / name, dtype=dtype, batch_size=config["features_batch_size"])
            out.append(FeatureShardDataset(root / name))
        else:
            out.append(None)
    return out


def build_draft(config, target, train_dataset, tokenizer):
    """A new draft for ``target`` (specialists optionally initialised, vocabulary optionally reduced)."""
    from ..configuration_poss import PosSDraftConfig
    from ..modeling_poss import PosSDraftModel
    from .trainer import init_specialists

    spec = config["draft"]
    draft_config = PosSDraftConfig.for_target(
        target.config, num_specialists=spec["num_specialists"], positions_per_specialist=spec["positions_per_specialist"],
        intermediate_size=spec.get("intermediate_size"), name_or_path=config["target"],
    )
    draft = PosSDraftModel(draft_config)
    if spec.get("init_from"):
        init_specialists(draft, spec["init_from"])
    if spec.get("draft_vocab_size"):
        from ..vocab import build_token_map, count_tokens, set_token_map, special_token_ids

        assistant = (item["input_ids"][item["assistant_mask"].bool()] for item in train_dataset)
        counts = count_tokens(assistant, draft_config.vocab_size)
        set_token_map(draft, build_token_map(counts, spec["draft_vocab_size"], special_token_ids(tokenizer)))
    return draft.attach_target(target)


def _last_checkpoint(output_dir):
    from .checkpoints import last_complete_checkpoint

    return last_complete_checkpoint(output_dir)


def train(config, target, tokenizer, train_dataset, eval_dataset):
    """Train (resuming from the last checkpoint in output_dir) and save the draft to output_dir/final."""
    from .trainer import PosSTrainer, PosSTrainingArguments

    training = dict(config["training"])
    if eval_dataset is None or not len(eval_dataset):
        training["eval_strategy"] = "no"
    args = PosSTrainingArguments(output_dir=config["output_dir"], seed=config["seed"],
                                 max_length=config["data"]["max_length"], **training)
    draft = build_draft(config, target, train_dataset, tokenizer)
    trainer = PosSTrainer(model=draft, args=args, target=target, train_dataset=train_dataset,
                          eval_dataset=eval_dataset, processing_class=tokenizer)
    result = trainer.train(resume_from_checkpoint=_last_checkpoint(config["output_dir"]))
    metrics = trainer.evaluate() if eval_dataset is not None and len(eval_dataset) else {}
    draft.model_card_extra = _card(config, result, metrics, len(train_dataset))
    final = Path(config["output_dir"]) / "final"
    draft.save_pretrained(final)
    (final / "training_recipe.json").write_text(json.dumps({"config": config, "eval": metrics}, indent=2, default=str))
    print(f"draft saved to {final}")
    return metrics


def _card(config, result, metrics, num_sequences) -> str:
    lines = ["## Training", "", f"- target: `{config['target']}`; {num_sequences} training sequences; "
             f"features: {config['features']}", f"- steps: {result.global_step}; final training loss: "
             f"{result.training_loss:.4f}", "", "Recipe (`poss train` config):", "", "```yaml",
             yaml.safe_dump({k: v for k, v in config.items() if k != "stage"}, sort_keys=False).strip(), "```"]
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
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; any other name is returned unchanged."""
    import torch

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def run(args) -> int:
    config = resolve_config(args.config, args.set, target=args.target, output_dir=args.output_dir, stage=args.stage)
    if args.dry_run:
        print(yaml.safe_dump(config, sort_keys=False))
        return 0
    from .recipe_checks import check_draft_fits, check_recipe

    check_recipe(config)  # before any model loads
    from transformers import set_seed

    from ..embedded import load_target

    set_seed(config["seed"])
    target, tokenizer = load_target(config["target"], device=resolve_device(config["device"]))
    check_draft_fits(config, target)  # before the data and feature stages
    train_dataset, eval_dataset = build_datasets(config, target, tokenizer)
    if config["stage"] in ("data", "features"):
        return 0
    train(config, target, tokenizer, train_dataset, eval_dataset)
    return 0
