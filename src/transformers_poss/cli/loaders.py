"""What the `poss` subcommands load, in one place: targets, drafts, quantization, prompts."""

from __future__ import annotations

import torch

from ..bench.run import encode_prompt
from ..targets.embedded import load_target, uses_chat_template

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_draft(source: str, target):
    """Load a draft for `target`: a PosS checkpoint, else an official PosS / EAGLE / HASS / EAGLE-3 one via ``from_official``."""
    from ..modeling_poss import PosSDraftModel

    try:
        draft = PosSDraftModel.from_pretrained(source)
    except (OSError, ValueError, KeyError) as error:
        if not hasattr(PosSDraftModel, "from_official"):
            raise
        try:
            draft = PosSDraftModel.from_official(source, target=target)
        except Exception as official_error:
            # an authors' checkpoint: its own loader's error says what is wrong (e.g. N not known); else the first
            raise (official_error if "from_official" in str(error) else error) from None
    if hasattr(draft, "attach_target") and not getattr(draft, "is_attached", False):
        draft.attach_target(target)
    return draft.to(device=target.device, dtype=target.dtype).eval()


def quantized(model, mode: str | None):
    """`model` with the requested weight quantization applied (``"none"`` leaves it as it is)."""
    if mode in (None, "none"):
        return model
    from ..quantization.int8 import apply_quantization

    return apply_quantization(model, mode)


__all__ = ["DTYPES", "encode_prompt", "load_draft", "load_target", "quantized", "uses_chat_template"]
