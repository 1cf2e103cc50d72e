"""Hand-over from the tree loop to transformers' own decoding loop once the automatic budget has fallen back.

With ``tree_total_tokens="auto"`` the budget may decide that speculation does not pay on this machine
(`budget.TreeBudget.should_fall_back`). The single-row loop then stops drafting and calls
``GenerationMixin._sample`` (stock greedy / multinomial decoding) for the rest of the call, continuing from the
target's cache, the tokens emitted so far and the attention mask, with the same logits processors, stopping
criteria, streamer, ``max_length`` and ``do_sample``. This is exactly the state plain ``generate`` would be in after
the same tokens, so outputs are unchanged (greedy: token-identical; sampling: the same processed distributions).

State at the hand-over: the cache holds every emitted token but the last one (the last round's bonus token), which
the stock loop feeds first, as its "prefill" of one token.
"""

from __future__ import annotations

import copy
import time

import torch

from .._transformers_compat import extend_model_kwargs, sample, set_mask_length
from ..speculation.target_cache import finish_cache_after_tree
from .outputs import PosSGenerateOutput


def continue_with_stock_loop(model, emitter, stats, cache, prompt_length: int, logits_processor, stopping_criteria,
                             generation_config, synced_gpus: bool, streamer, model_kwargs: dict):  # fmt: skip
    """Finish the call with ``model._sample`` from the tree loop's current state.

    Args:
        model: the target.
        emitter: the tree loop's `emitter.Emitter` (``input_ids`` so far, ``scores`` / ``raw_logits`` tuples or None).
        stats (`AcceptanceStats`): completed with the stock loop's steps (`AcceptanceStats.record_plain_steps`).
        cache (`DynamicCache`): the target cache, holding ``emitter.input_ids`` but its last token.
        prompt_length: length of the prompt ``generate`` was called with (the attention mask and position ids in
            ``model_kwargs`` still have that length).
        logits_processor, stopping_criteria, generation_config, synced_gpus, streamer: as ``generate`` prepared them.
        model_kwargs: the model kwargs ``generate`` passed to the loop.

    Returns:
        What ``generate`` returns: the sequences, or a `PosSGenerateOutput` whose ``scores`` / ``logits`` are the tree
        part's followed by the stock part's.
    """
    input_ids = emitter.input_ids
    if cache.get_seq_length() != input_ids.shape[1] - 1:
        raise RuntimeError("the target cache must hold every token but the last one at the hand-over")
    finish_cache_after_tree(cache)  # sliding-window layers trim themselves again, as in plain decoding
    kwargs = dict(model_kwargs)
    kwargs["cache"] = cache
    kwargs["use_cache"] = True
    # attention mask, position ids, token type ids: extended by the emitted tokens as plain decoding would have
    kwargs = extend_model_kwargs(model, kwargs, num_new_tokens=input_ids.shape[1] - prompt_length)
    config = copy.copy(generation_config)
    if kwargs.get("attention_mask") is None:
        set_mask_length(config, input_ids.shape[1])  # without a mask, `_prefill` slices the inputs by this length
    start = time.perf_counter()
    out = sample(model, input_ids, logits_processor, stopping_criteria, config, synced_gpus, streamer, **kwargs)
    stats.add_time("plain_decoding", time.perf_counter() - start)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    stats.record_plain_steps(sequences.shape[1] - input_ids.shape[1])
    if isinstance(out, torch.Tensor):
        return out
    return PosSGenerateOutput(
        sequences=sequences,
        scores=_joined(emitter.scores, out.scores),
        logits=_joined(emitter.raw_logits, out.logits),
        cache=out.cache if out.cache is not None else cache,
        acceptance=stats,
    )


def _joined(first: tuple | None, second: tuple | None) -> tuple | None:
    if first is None:
        return second
    return first + tuple(second or ())
