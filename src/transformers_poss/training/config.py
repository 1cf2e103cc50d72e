"""The one configuration schema of `poss train`: typed dataclasses parsed by transformers' `HfArgumentParser`.

A run is described by four dataclasses, each field once:

- [`PosSScriptArguments`]: the target, which stages run, where features live and where the target runs;
- [`PosSDraftArguments`]: the draft's shape and where it starts from;
- [`PosSDataArguments`]: training data and self-distillation;
- [`PosSTrainingArguments`]: the Trainer's arguments plus the objective's (``output_dir``, ``seed`` and
  ``max_length`` live here).

A recipe file (YAML or JSON) holds the same fields, flat or grouped in the sections ``draft:``, ``data:`` (with an
optional ``generation:`` group) and ``training:``; command-line flags override it:

    poss train --config recipe.yaml --learning_rate 1e-3 --num_specialists 3

Every value goes through the parser's types (``1e-3`` is a float, ``eval_strategy: no`` stays ``"no"``), an unknown
key is an error, and ``poss train --help`` lists every field with its default.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import json
from dataclasses import dataclass, field, fields
from typing import Literal

import yaml

from .trainer import PosSTrainingArguments

__all__ = ["PosSScriptArguments", "PosSDraftArguments", "PosSDataArguments", "PosSTrainConfig", "parse_train_args",
           "load_recipe"]


@dataclass
class PosSScriptArguments:
    """What runs and where."""

    target: str | None = field(default=None, metadata={"help": "Target model: embedded name, Hub id or folder."})
    stage: Literal["data", "features", "train", "all"] = field(
        default="all", metadata={"help": "Run only this stage (each stage resumes where it stopped)."}
    )
    features: Literal["offline", "online"] = field(
        default="offline", metadata={"help": "offline: bf16 shards computed once; online: the target runs per step."}
    )
    features_dir: str | None = field(default=None, metadata={"help": "Feature shards (default output_dir/features)."})
    features_dtype: Literal["bfloat16", "float16", "float32"] = field(
        default="bfloat16", metadata={"help": "Storage dtype of offline features."}
    )
    features_batch_size: int = field(default=8, metadata={"help": "Sequences per target forward for features."})
    features_autocast: bool = field(
        default=False, metadata={"help": "Compute offline features under bf16 autocast (faster on CPUs with bf16 "
                                         "units; features about 1 percent off the float32 ones)."}
    )
    device: str = field(default="auto", metadata={"help": "Where the target runs (auto: this process's GPU if any)."})
    dry_run: bool = field(default=False, metadata={"help": "Print the resolved configuration and exit."})


@dataclass
class PosSDraftArguments:
    """The draft: S specialists of N positions each (EAGLE-2: 1 x 1, HASS: 1 x K), reading the target's post-norm
    feature or, with ``feature_layers``, several of its hidden states (EAGLE-3 style)."""

    num_specialists: int = field(default=1, metadata={"help": "Specialist layers S."})
    positions_per_specialist: int = field(default=1, metadata={"help": "Draft positions per specialist N."})
    init_from: str | None = field(
        default=None, metadata={"help": "Trained draft whose layer, fc and token map start every specialist."}
    )
    draft_vocab_size: int | None = field(
        default=None, metadata={"help": "Reduced drafting vocabulary built from the data (kept from init_from)."}
    )
    intermediate_size: int | None = field(default=None, metadata={"help": "MLP width (default: the target's)."})
    feature_layers: list[int] | None = field(
        default=None,
        metadata={"help": "Target hidden states the draft reads, EAGLE-3 style (indices into hidden_states: 0 = "
                          "embeddings, num_hidden_layers = post-norm), e.g. 2 15 27; None: the post-norm feature."},
    )
    layer_style: Literal["eagle2", "eagle3"] = field(
        default="eagle2",
        metadata={"help": "Specialist layers: eagle2 (fc, then a decoder layer) or eagle3 (EAGLE-3's midlayer)."},
    )
    feature_fc_init: Literal["fit", "identity"] = field(
        default="fit",
        metadata={"help": "Warm start of a feature_layers draft from a single-feature init_from draft: feature_fc "
                          "fitted by least squares onto the post-norm feature, or identity on the highest layer."},
    )


@dataclass
class PosSDataArguments:
    """Training data: given conversations and/or prompts answered by the target itself."""

    train: list[str] = field(default_factory=list, metadata={"help": "ShareGPT / OpenAI JSON(L) files or datasets."})
    prompts: list[str] = field(default_factory=list, metadata={"help": '{"prompt": ...} JSONL files to answer.'})
    synthesize_prompts: int = field(default=0, metadata={"help": "Prompts the target writes itself."})
    self_distill: bool = field(default=False, metadata={"help": "Regenerate the assistant turns of `train`."})
    distill_dir: str | None = field(default=None, metadata={"help": "Generated files (default output_dir/data)."})
    eval: str | None = field(default=None, metadata={"help": "Held-out conversations (else eval_fraction)."})
    eval_fraction: float = field(default=0.02, metadata={"help": "Share of the conversations held out."})
    max_conversations: int | None = field(
        default=None, metadata={"help": "Train on the first N conversations of the seeded shuffle only."}
    )
    generation_batch_size: int = field(default=16, metadata={"help": "Answers generated together."})
    generation_max_new_tokens: int = field(default=512, metadata={"help": "Answer length cap."})
    generation_temperature: float = field(default=0.0, metadata={"help": "0: greedy answers."})
    prompt_batch_size: int = field(default=32, metadata={"help": "Prompts sampled together."})
    prompt_max_new_tokens: int = field(default=96, metadata={"help": "Prompt length cap."})
    generation_int8: bool = field(default=False, metadata={"help": "Generate with an int8 copy (CPU, ~2x/step)."})


@dataclass
class PosSTrainConfig:
    """One resolved `poss train` run."""

    script: PosSScriptArguments
    draft: PosSDraftArguments
    data: PosSDataArguments
    training: PosSTrainingArguments

    def to_dict(self) -> dict:
        """The run's settings by section; ``training`` holds only the fields that differ from their defaults."""
        defaults = PosSTrainingArguments(output_dir=self.training.output_dir)
        training = {f.name: getattr(self.training, f.name) for f in fields(PosSTrainingArguments)
                    if f.init and _plain(getattr(self.training, f.name)) != _plain(getattr(defaults, f.name))}
        training = {"output_dir": self.training.output_dir, "seed": self.training.seed, **training}
        out = {"script": _as_dict(self.script), "draft": _as_dict(self.draft), "data": _as_dict(self.data),
               "training": {k: _plain(v) for k, v in training.items()}}
        out["script"].pop("dry_run")
        return out


SECTIONS = {"draft": PosSDraftArguments, "data": PosSDataArguments, "training": PosSTrainingArguments}
# keys of a sectioned recipe that live in another dataclass, and the data.generation group
_RENAMED = {("data", "max_length"): "max_length", ("training", "target"): "target"}
_GENERATION = {"batch_size": "generation_batch_size", "max_new_tokens": "generation_max_new_tokens",
               "temperature": "generation_temperature", "int8": "generation_int8",
               "prompt_batch_size": "prompt_batch_size", "prompt_max_new_tokens": "prompt_max_new_tokens"}
_TYPES = (PosSScriptArguments, PosSDraftArguments, PosSDataArguments, PosSTrainingArguments)


def _plain(value):
    return value.value if isinstance(value, enum.Enum) else value  # enums (eval_strategy, ...)


def _as_dict(instance) -> dict:
    return {f.name: getattr(instance, f.name) for f in fields(instance)}


def _field_names(kind) -> set[str]:
    return {f.name for f in fields(kind) if f.init}


def _unknown(key: str, known: set[str], where: str) -> SystemExit:
    close = difflib.get_close_matches(key, sorted(known), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `poss train --help` lists every field"
    return SystemExit(f"unknown setting {key!r} in {where}{hint}")


def load_recipe(path: str) -> dict:
    """A recipe file as flat ``{field: value}`` (values kept as written: the parser types them).

    YAML is read without its implicit typing (``no`` stays the text ``no``, ``1e-3`` the text ``1e-3``), so every
    value is typed once, by the field it goes to.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle) if str(path).endswith(".json") else yaml.load(handle, Loader=yaml.BaseLoader)
    except FileNotFoundError:
        raise SystemExit(f"recipe file not found: {path}") from None
    except (ValueError, yaml.YAMLError) as error:
        raise SystemExit(f"cannot read the recipe {path}: {error}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SystemExit(f"the recipe {path} must be a mapping of settings, got {type(loaded).__name__}")
    everything = set().union(*(_field_names(kind) for kind in _TYPES))
    flat: dict = {}
    for key, value in loaded.items():
        if key in SECTIONS and isinstance(value, dict):
            known = _field_names(SECTIONS[key])
            for sub, item in value.items():
                if key == "data" and sub == "generation" and isinstance(item, dict):
                    for gen, setting in item.items():
                        if gen not in _GENERATION:
                            raise _unknown(gen, set(_GENERATION), f"{path} (data.generation)")
                        flat[_GENERATION[gen]] = setting
                    continue
                name = _RENAMED.get((key, sub), sub)
                if name not in known and (key, sub) not in _RENAMED:
                    raise _unknown(sub, known, f"{path} ({key}:)")
                flat[name] = item
        elif key in everything:
            flat[key] = value
        else:
            raise _unknown(key, everything, path)
    return flat


def _is_null(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip() in ("", "~", "null", "Null", "NULL", "None"))


def _as_flags(flat: dict) -> list[str]:
    """Command-line tokens for recipe values (lists become several values; null values are left to the caller)."""
    tokens = []
    for key, value in flat.items():
        if isinstance(value, dict):
            raise SystemExit(f"setting {key!r} must be a value or a list, not a mapping")
        values = value if isinstance(value, list) else [value]
        if _is_null(value) or not values:
            continue
        tokens.append(f"--{key}")
        tokens += [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
    return tokens


def _optional(kind, name: str) -> bool:
    """Whether field ``name`` of dataclass ``kind`` admits ``None`` (read from the annotations as written:
    `HfArgumentParser` replaces a field's resolved type by its non-None part)."""
    for klass in kind.__mro__:
        annotation = klass.__dict__.get("__annotations__", {}).get(name)
        if annotation is not None:
            text = str(annotation)
            return "None" in text or "Optional" in text
    return False


def _clear(instances, names) -> None:
    """Set the optional fields named (null in the recipe, or ``None`` given for a text field) to ``None``."""
    for instance in instances:
        for f in fields(instance):
            value = getattr(instance, f.name)
            if not _optional(type(instance), f.name):
                continue
            if f.name in names or (isinstance(value, str) and _is_null(value)):
                setattr(instance, f.name, None)


def _null_list_flags(tokens: list[str]) -> set[str]:
    """Remove ``--name None`` (or ``null``) of optional list fields from ``tokens``; returns those names."""
    lists = {f.name for kind in _TYPES for f in fields(kind) if f.init and _optional(kind, f.name)
             and "list" in str(next((k.__dict__.get("__annotations__", {}).get(f.name) for k in kind.__mro__
                                     if f.name in k.__dict__.get("__annotations__", {})), ""))}
    names, i = set(), 0
    while i < len(tokens):
        name = tokens[i][2:].replace("-", "_") if tokens[i].startswith("--") else None
        if name in lists and i + 1 < len(tokens) and _is_null(tokens[i + 1]) and \
                (i + 2 == len(tokens) or tokens[i + 2].startswith("--")):
            names.add(name)
            del tokens[i : i + 2]
            continue
        i += 1
    return names


def build_parser():
    from transformers import HfArgumentParser

    from ..cli import epilog

    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Defaults shown (as HfArgumentParser does); the closing example printed as written."""

    parser = HfArgumentParser(_TYPES, prog="poss train", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                              epilog=epilog("train"), formatter_class=Formatter)
    parser.add_argument("--config", default=None, help="YAML or JSON recipe with the fields below (flat or by section)")
    parser.add_argument("--output", dest="output_dir", default=argparse.SUPPRESS,
                        help="the same as --output_dir (every poss command writes where --output says)")

    def error(message):  # one line instead of argparse's page-long usage
        raise SystemExit(f"poss train: {message} (`poss train --help` lists every option)")

    parser.error = error
    return parser


def parse_train_args(argv: list[str]) -> PosSTrainConfig:
    """Recipe file (``--config``) <- command-line flags, typed and checked by `HfArgumentParser`."""
    parser = build_parser()
    config_path = None
    rest = list(argv)
    for i, token in enumerate(rest):
        if token == "--config" and i + 1 < len(rest):
            config_path = rest[i + 1]
            del rest[i : i + 2]
            break
        if token.startswith("--config="):
            config_path = token.split("=", 1)[1]
            del rest[i]
            break
    recipe = load_recipe(config_path) if config_path else {}
    recipe.setdefault("output_dir", "poss-draft")
    recipe.setdefault("seed", 0)  # the held-out split and the draft's initialisation
    cleared = _null_list_flags(rest)  # `--feature_layers None`: a list field the parser would type element-wise
    for name in cleared:
        recipe.pop(name, None)
    try:
        parsed = parser.parse_args_into_dataclasses(args=_as_flags(recipe) + rest, look_for_args_file=False)
    except ValueError as error:  # a value the field's __post_init__ refuses, or flags that are not fields
        raise SystemExit(f"poss train: {error}") from None
    script, draft, data, training = parsed[:4]
    given = {token[2:].split("=", 1)[0].replace("-", "_") for token in rest if token.startswith("--")}
    given |= {"output_dir"} if "output" in given else set()  # --output is --output_dir
    _clear((script, draft, data, training),
           {k for k, v in recipe.items() if _is_null(v) and k not in given} | cleared)
    if not script.target:
        raise SystemExit("a target is required (recipe `target:` or --target)")
    return PosSTrainConfig(script, draft, data, training)
