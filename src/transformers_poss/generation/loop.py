"""The single-row tree-verification loop (B = 1), with the automatic budget and the hand-over on top of the shared
speculation core; B > 1 rows go to `batched.generate_batch`.

Each round:
1. `PosSCandidateGenerator` drafts a tree from the context pairs accepted since the previous round (the shared
   `speculation.drafter.PosSProposer`, a batch of one);
2. ONE target forward over the tree nodes (`target_forward.verify_tree`: 4D tree mask, position = context length +
   depth; a chain goes through the plain causal path) gives logits and the post-norm features;
3. `speculation.acceptance.accept_tree` picks the accepted path (greedy or rejection sampling after the same logits
   processors ``generate`` applies);
4. `speculation.target_cache.compact_cache` keeps only the accepted rows; the emitted tokens are appended one at a
   time through the stopping criteria (`emission.Emitter`), so generation stops exactly where plain ``generate``
   would.

With ``tree_total_tokens="auto"`` the budget may find that speculation does not pay: it first pauses it for a stretch
of plain rounds (root-only trees, nothing drafted) and then speculates again; once a pause would outlast the call, a
fallback hands the rest of the call to transformers' own decoding loop (`handover.continue_with_stock_loop`).
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicCache

from .._transformers_compat import prefill
from ..speculation.acceptance import accept_tree
from ..speculation.stats import AcceptanceStats
from ..speculation.target_cache import (compact_cache, finish_cache_after_tree, prepare_cache_for_tree,
                                        use_growing_layers)
from ..speculation.tree import DraftTree
from .batched import generate_batch
from .candidate_generator import PosSCandidateGenerator
from .emission import Emitter, first_token
from .handover import continue_with_stock_loop
from .outputs import PosSGenerateOutput
from .target_forward import feature_request, read_features, verify_tree
from .validation import check_inputs


def limit_tree_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """The subtree of nodes at depth ``<= max_depth`` (parents stay before children, so it is still a tree)."""
    keep = tree.depths <= max_depth
    return tree if bool(keep.all()) else tree.select(keep)


def tree_assisted_decoding(
    self,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    """The tree-verification loop: same inputs and outputs as `GenerationMixin._assisted_decoding`."""
    check_inputs(self, input_ids, generation_config, model_kwargs, synced_gpus)
    if input_ids.shape[0] > 1:  # B > 1 rows: the batched loop (B = 1 keeps this loop)
        return generate_batch(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                              assistant_model, model_kwargs)  # fmt: skip
    candidate_generator = PosSCandidateGenerator(assistant_model, self, generation_config)
    do_sample = bool(generation_config.do_sample)
    return_dict = generation_config.return_dict_in_generate
    stats = AcceptanceStats()
    emitter = Emitter(
        input_ids,
        stopping_criteria,
        streamer,
        scores=() if return_dict and generation_config.output_scores else None,
        raw_logits=() if return_dict and generation_config.output_logits else None,
    )
    if model_kwargs.get("cache") is None:
        model_kwargs["cache"] = DynamicCache(config=self.config.get_text_config(decoder=True))
    model_kwargs["use_cache"] = True
    cache = model_kwargs["cache"]
    attention_mask = model_kwargs.get("attention_mask")
    context_mask = None if attention_mask is None else attention_mask[0].bool()
    if context_mask is not None and bool(context_mask.all()):
        context_mask = None  # no padding: chains take the unmasked causal path, trees a mask without padding holes

    # prefill: last-position logits and every prompt position's features (those the draft reads) in the same forward
    feature_layers = candidate_generator.draft.config.feature_layers
    outputs = prefill(self, input_ids, generation_config,
                      {**model_kwargs, "output_hidden_states": feature_request(feature_layers)})  # fmt: skip
    new_features = read_features(outputs.hidden_states, feature_layers)  # [1, T, k*H]
    if new_features.shape[1] != input_ids.shape[1]:
        raise ValueError("Tree speculative decoding needs the features of the whole prompt: unset prefill_chunk_size.")
    prepare_cache_for_tree(cache)
    use_growing_layers(cache)  # rounds append their nodes without copying the whole cache (`GrowingLayer`)
    logits = outputs.logits[:, -1].to(dtype=torch.float32, device=input_ids.device)
    del outputs
    token, scores = first_token(logits, input_ids, logits_processor, do_sample)
    emitter.emit(token, scores, logits)
    new_tokens = torch.cat([input_ids[:, 1:], token[:, None]], dim=-1)

    while not emitter.finished and not candidate_generator.falls_back(
            generation_config.max_length - emitter.input_ids.shape[1]):
        clock = round_start = time.perf_counter()
        pausing = candidate_generator.pausing  # a plain stretch of the budget: timed and counted as plain decoding
        spend = (lambda phase, seconds: stats.add_time("plain_decoding", seconds)) if pausing else stats.add_time
        tree, _ = candidate_generator.get_candidates(emitter.input_ids, new_tokens, new_features)
        budget = generation_config.max_length - emitter.input_ids.shape[1]
        tree = limit_tree_depth(tree, max(budget - 1, 0))
        spend("drafting", time.perf_counter() - clock)

        clock = time.perf_counter()
        past_length = cache.get_seq_length()
        root_position = past_length if context_mask is None else int(context_mask.sum().item())
        logits, features = verify_tree(self, tree, cache, root_position, context_mask, feature_layers)
        logits = logits.to(dtype=torch.float32, device=input_ids.device)
        verify_seconds = time.perf_counter() - clock
        spend("verification", verify_seconds)

        clock = time.perf_counter()
        accepted = accept_tree(tree, logits, emitter.input_ids, logits_processor, do_sample)
        stats.record(accepted.num_accepted, accepted.proposed_next, depth=tree.max_depth)
        if tree.sources is not None:  # context candidates: which source proposed the accepted tokens
            stats.record_sources(tree.sources[accepted.path[1:].to(tree.sources.device)].tolist())
        candidate_generator.observe(tree, accepted)
        spend("acceptance", time.perf_counter() - clock)

        clock = time.perf_counter()
        compact_cache(cache, tree.num_nodes, accepted.path)
        if context_mask is not None:
            context_mask = torch.cat([context_mask, context_mask.new_ones(accepted.path.shape[0])])
        spend("cache_update", time.perf_counter() - clock)
        candidate_generator.observe_seconds(time.perf_counter() - round_start, verify_seconds, tree.num_nodes)
        if pausing:
            stats.record_paused_step()

        emitter.emit(accepted.tokens, accepted.scores, logits[accepted.path])
        new_tokens = accepted.tokens[None]
        new_features = features[accepted.path.to(features.device)][None]

    stats.rounds = candidate_generator.rounds
    stats.fell_back_to_plain = candidate_generator.fell_back
    candidate_generator.check_profile()
    if not emitter.finished:  # the budget fell back: transformers' own loop finishes the call
        return continue_with_stock_loop(self, emitter, stats, cache, input_ids.shape[1], logits_processor,
                                        stopping_criteria, generation_config, synced_gpus, streamer, model_kwargs)
    finish_cache_after_tree(cache)
    if streamer is not None:
        streamer.end()
    if not return_dict:
        return emitter.input_ids
    return PosSGenerateOutput(
        sequences=emitter.input_ids,
        scores=emitter.scores,
        logits=emitter.raw_logits,
        cache=cache,
        acceptance=stats,
    )
