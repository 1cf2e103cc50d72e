"""The generation hook: ``target.generate(assistant_model=draft)`` runs tree speculation for a PosS draft.

``generate`` routes ``assistant_model=...`` to ``GenerationMixin._assisted_decoding``, which verifies one linear
chain. `enable_tree_generation` (called on ``import transformers_poss``) wraps that method and
``_validate_generation_mode`` so that a `PosSDraftModel` assistant (or a peft ``PeftModel`` around one) runs the tree loop (`loop.tree_assisted_decoding`),
and any other assistant (a small LM, prompt lookup, ...) keeps the stock path untouched. `disable_tree_generation`
restores the original methods. Both methods are reached through `transformers_poss._transformers_compat`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .._transformers_compat import PATCHED_METHODS, current_method, original_method, set_method
from .candidate_generator import tree_draft_of
from .loop import tree_assisted_decoding
from .validation import check_generation_config

_ORIGINALS: dict[str, object] = {}


@contextmanager
def draft_placement_kept(draft):
    """Give ``draft`` back on the devices and in the dtypes it came in: the loops move it to the target's lm_head
    device and cast it to the target's dtype for the call (`candidate_generator.place_draft`), and the caller's model
    must not change behind its back (saving a bf16 draft afterwards would double the checkpoint). A float cast to a
    wider float and back is exact."""
    if draft is None:
        yield
        return
    tensors = lambda: [*draft.named_parameters(), *draft.named_buffers()]  # noqa: E731
    before = {name: (tensor.device, tensor.dtype) for name, tensor in tensors()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, tensor in tensors():
                device, dtype = before.get(name, (tensor.device, tensor.dtype))
                if tensor.device != device or tensor.dtype != dtype:
                    tensor.data = tensor.data.to(device, dtype)


def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                       streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None,
                       tokenizer=None, **model_kwargs):  # fmt: skip
    """`GenerationMixin._assisted_decoding`, routed to the tree loop when the assistant is a PosS draft."""
    draft = tree_draft_of(assistant_model)
    method = _ORIGINALS["_assisted_decoding"] if draft is None else tree_assisted_decoding
    assistant_model = assistant_model if draft is None else draft
    with draft_placement_kept(draft):
        return method(
            self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs,
        )  # fmt: skip


def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    """`GenerationMixin._validate_generation_mode` with the checks of a PosS draft instead of the vocab comparison."""
    draft = tree_draft_of(generation_mode_kwargs.get("assistant_model"))
    if draft is not None:
        check_generation_config(self, draft, generation_mode, generation_config)
        generation_mode_kwargs = {k: v for k, v in generation_mode_kwargs.items() if k != "assistant_model"}
    return _ORIGINALS["_validate_generation_mode"](self, generation_mode, generation_config, generation_mode_kwargs)


_PATCHES = {"_assisted_decoding": _assisted_decoding, "_validate_generation_mode": _validate_generation_mode}
assert tuple(_PATCHES) == PATCHED_METHODS


def enable_tree_generation() -> None:
    """Make ``generate(assistant_model=<PosS draft>)`` run tree speculation (idempotent; done on import)."""
    for name, patch in _PATCHES.items():
        current = original_method(name)
        if current is patch:
            continue
        _ORIGINALS[name] = current
        set_method(name, patch)


def disable_tree_generation() -> None:
    """Restore transformers' own assisted decoding (a PosS draft then fails in the stock validation)."""
    for name, original in list(_ORIGINALS.items()):
        if current_method(name) is _PATCHES[name]:
            set_method(name, original)
        del _ORIGINALS[name]


def is_tree_generation_enabled() -> bool:
    return all(current_method(name) is patch for name, patch in _PATCHES.items())
