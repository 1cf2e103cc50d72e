"""The tree loop as a ``custom_generate`` callable: ``target.generate(custom_generate=generate, draft=draft)``.

transformers calls a ``custom_generate`` callable after all of ``generate``'s preparation (logits processors,
stopping criteria, generation config, cache, attention mask) with ``(model, input_ids, logits_processor=...,
stopping_criteria=..., generation_config=..., **model_kwargs)``, plus the keyword arguments of the call that the
callable itself declares beyond those of ``GenerationMixin._sample``: here ``draft``. It does not pass
``assistant_model``, ``streamer`` or ``synced_gpus`` to a callable, so the draft is given as ``draft=`` and streaming
needs the ``assistant_model=`` path (the generation hook). This entry does not depend on the hook: it works with
`disable_tree_generation` too.
"""

from __future__ import annotations

from .candidate_generator import tree_draft_of
from .hook import draft_placement_kept
from .loop import tree_assisted_decoding
from .validation import check_generation_config


def generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, draft=None,
             **model_kwargs):  # fmt: skip
    """Tree speculative decoding of ``model`` with the PosS ``draft``; returns what ``generate`` returns.

    Example::

        from transformers_poss.generation import generate as poss_generate

        out = target.generate(**inputs, custom_generate=poss_generate, draft=draft, max_new_tokens=64)
    """
    draft = tree_draft_of(draft)  # a PeftModel around a draft: the draft, its adapters active
    if draft is None:
        raise ValueError(
            "custom_generate=transformers_poss.generation.generate needs the PosS draft as `draft=`: "
            "target.generate(**inputs, custom_generate=generate, draft=draft)."
        )
    check_generation_config(model, draft, generation_config.get_generation_mode(draft), generation_config)
    with draft_placement_kept(draft):  # the caller's draft keeps its device and dtype
        return tree_assisted_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                      assistant_model=draft, **model_kwargs)  # fmt: skip
