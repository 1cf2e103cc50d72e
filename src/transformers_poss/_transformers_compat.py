"""The one seam between this package and transformers' private internals.

Every private transformers name the package relies on is used here and nowhere else. On import each method is
looked up and its parameters are compared with the ones this package calls it with; when one is missing or its
parameters changed, one `ImportError` names all of them and the transformers versions that work, instead of a
failure (or, worse, a silent change of behaviour) in the middle of a ``generate`` call.

Checked: ``GenerationMixin._assisted_decoding`` / ``_validate_generation_mode`` (replaced by the generation hook),
``_prefill`` / ``_sample`` / ``_update_model_kwargs_for_generation`` (the tree loop and the hand-over),
``_get_candidate_generator`` (the bench's round recorder) and ``_supports_logits_to_keep`` (verification forwards).
Attributes read at run time (``config._attn_implementation``, ``generation_config._pad_token_tensor`` /
``_mask_length``) go through the accessors below as well. ``Trainer._save_checkpoint`` / ``_get_output_dir``
(overridden by the atomic checkpoints of `training.checkpoints`) and ``_get_train_sampler`` (`PosSTrainer`'s
length-grouped batches) are checked by `check_trainer` when `training.checkpoints` is imported.
"""

from __future__ import annotations

import inspect
import os

import transformers
from transformers.generation.utils import GenerationMixin

SUPPORTED_TRANSFORMERS = ">=5.24,<6"

# (owner, name) -> the parameters this package passes (a release may add more; none of these may go)
EXPECTED_PARAMETERS: dict[tuple[type, str], tuple[str, ...]] = {
    (GenerationMixin, "_assisted_decoding"): (
        "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer",
        "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer",
    ),
    (GenerationMixin, "_validate_generation_mode"): ("generation_mode", "generation_config", "generation_mode_kwargs"),
    (GenerationMixin, "_prefill"): ("input_ids", "generation_config", "model_kwargs"),
    (GenerationMixin, "_sample"): (
        "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer",
    ),
    (GenerationMixin, "_update_model_kwargs_for_generation"): ("outputs", "model_kwargs", "num_new_tokens"),
    (GenerationMixin, "_get_candidate_generator"): (
        "generation_config", "input_ids", "inputs_tensor", "logits_processor", "model_kwargs", "assistant_model",
    ),
    (GenerationMixin, "_supports_logits_to_keep"): (),
}

# the methods `generation.hook` replaces on GenerationMixin
PATCHED_METHODS = ("_assisted_decoding", "_validate_generation_mode")


def incompatibilities(expected: dict[tuple[type, str], tuple[str, ...]] | None = None) -> list[str]:
    """One line per private name that is missing or lacks a parameter this package passes (empty: all good)."""
    problems = []
    for (owner, name), parameters in (EXPECTED_PARAMETERS if expected is None else expected).items():
        method = owner.__dict__.get(name)
        if method is None or not callable(method):
            problems.append(f"{owner.__name__}.{name} is missing")
            continue
        found = inspect.signature(method).parameters
        missing = [p for p in parameters if p not in found]
        if missing:
            problems.append(f"{owner.__name__}.{name} has no parameter(s) {', '.join(missing)}")
    return problems


def check_transformers(expected: dict[tuple[type, str], tuple[str, ...]] | None = None) -> None:
    """Raise one `ImportError` listing every incompatibility with the installed transformers."""
    problems = incompatibilities(expected)
    if problems:
        raise ImportError(
            f"transformers-poss needs transformers{SUPPORTED_TRANSFORMERS}, but the installed transformers "
            f"{transformers.__version__} differs in the private internals tree speculation builds on:\n  - "
            + "\n  - ".join(problems)
            + f"\nInstall a supported release: pip install 'transformers{SUPPORTED_TRANSFORMERS}'."
        )


check_transformers()


# ------------------------------------------------------------------------------------------------ GenerationMixin
def original_method(name: str):
    """The method ``name`` as GenerationMixin defines it now (before the hook replaces it)."""
    return GenerationMixin.__dict__[name]


def set_method(name: str, method) -> None:
    setattr(GenerationMixin, name, method)


def current_method(name: str):
    return GenerationMixin.__dict__.get(name)


def prefill(model, input_ids, generation_config, model_kwargs: dict):
    """``model._prefill``: the prompt forward of ``generate`` (chunked prefill, cache set-up included)."""
    return model._prefill(input_ids, generation_config, model_kwargs)


def sample(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
           **model_kwargs):  # fmt: skip
    """``model._sample``: transformers' own greedy / multinomial decoding loop."""
    return model._sample(input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
                         streamer=streamer, **model_kwargs)  # fmt: skip


def extend_model_kwargs(model, model_kwargs: dict, num_new_tokens: int) -> dict:
    """Attention mask, position ids, token type ids extended by ``num_new_tokens`` as plain decoding extends them."""
    return model._update_model_kwargs_for_generation({}, model_kwargs, num_new_tokens=num_new_tokens)


def supports_logits_to_keep(model) -> bool:
    return model._supports_logits_to_keep()


def wrap_candidate_generator(model, wrapper) -> None:
    """Make ``model`` (this instance only) build its assisted-decoding candidate generators with
    ``wrapper(build, *args, **kwargs)``; `unwrap_candidate_generator` undoes it."""
    build = model._get_candidate_generator
    model._get_candidate_generator = lambda *args, **kwargs: wrapper(build, *args, **kwargs)


def unwrap_candidate_generator(model) -> None:
    del model._get_candidate_generator


# ------------------------------------------------------------------------------------------------ attributes
def attn_implementation(config) -> str | None:
    """The attention implementation a (text) config selects."""
    return config._attn_implementation


def register_attention(name: str, forward) -> None:
    """Register ``forward`` as ``attn_implementation=name`` with transformers' attention interface, with the masks
    transformers builds for SDPA (boolean; causal / sliding-window / padding rules). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def set_attn_implementation(config, name: str) -> None:
    """Select attention implementation ``name`` (registered with ``AttentionInterface``) in ``config`` and its
    sub-configs, for the forwards that read it next."""
    config._attn_implementation = name


def pad_token_tensor(generation_config):
    """The pad token ``generate`` prepared (a tensor, or None)."""
    return getattr(generation_config, "_pad_token_tensor", None)


def set_mask_length(generation_config, length: int) -> None:
    """Without an attention mask, ``_prefill`` slices the inputs by this length."""
    generation_config._mask_length = length


# ------------------------------------------------------------------------------------------------ Trainer
# the Trainer methods `training.checkpoints.AtomicCheckpointMixin` overrides (checked when that module is imported,
# so that importing the package does not import the Trainer)
TRAINER_PARAMETERS: dict[str, tuple[str, ...]] = {"_save_checkpoint": ("model", "trial"), "_get_output_dir": ("trial",),
                                                   "_get_train_sampler": ("train_dataset",)}


def check_trainer() -> None:
    """One `ImportError` when a Trainer method the atomic checkpoints or `PosSTrainer` override is missing or changed."""
    from transformers import Trainer

    check_transformers({(Trainer, name): parameters for name, parameters in TRAINER_PARAMETERS.items()})


def custom_generate_location() -> str | None:
    """The ``custom_generate=`` folder or Hub id of the `GenerationMixin.generate` call running now, or None.

    transformers runs a repository's ``custom_generate/generate.py`` from a copy in its modules cache and does not
    pass the repository to it; the running ``generate`` frame (a local variable ``custom_generate``) still names it.
    This is what lets an exported folder find the draft stored beside its code after being copied or moved.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == GenerationMixin.__module__:
            value = frame.f_locals.get("custom_generate")
            return str(value) if isinstance(value, (str, os.PathLike)) else None
        frame = frame.f_back
    return None
