"""Tree speculative decoding for a batch of B > 1 left-padded prompts, lossless per row.

``generate(**batch, assistant_model=draft)`` with B > 1 rows lands here (`loop.tree_assisted_decoding` keeps its
single-row loop for B = 1). It runs on the same speculation core as B = 1. Each round:

1. `speculation.drafter.PosSProposer` drafts one tree per row (one draft pass per tree depth for all rows);
2. ONE target forward verifies all rows' trees (`[B, n]` nodes; a row's nodes deeper than its remaining token budget
   are invalid: computed, never accepted), with per-row 4D masks and position ids (`speculation.masks`); chains on a
   full-attention target take the plain causal path (2D mask) instead (`target_forward.verify_batch`);
3. each row accepts its own path (`speculation.acceptance.accept_batch`);
4. the accepted nodes are kept right-aligned in ``m = max_b(accepted_b + 1)`` new cache columns, holes masked;
5. each row's tokens go through the stopping criteria one at a time; finished rows leave the batch (target cache,
   layout and draft caches), and holes shared by all rows are dropped when worthwhile.

Sequences come back like stock batched ``generate``: prompts as given, finished rows padded with ``pad_token_id``.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import LogitsProcessorList
from transformers.utils import logging

from .._transformers_compat import pad_token_tensor, sample
from ..configuration_poss import DEFAULT_TREE_SHAPE
from ..speculation.acceptance import accept_batch, identity_processor
from ..speculation.drafter import PosSProposer
from ..speculation.masks import BatchLayout, relayout_index
from ..speculation.stats import AcceptanceStats
from ..speculation.target_cache import full_layer_cache, gather_cache_columns, keep_accepted, select_cache_rows
from ..speculation.sampled_drafter import SampledTreeProposer
from .candidate_generator import context_tokens, lm_head_device, place_draft, sampled_tree_warping, tree_shape
from .hybrid import ContextCandidates, on_path_mask
from .outputs import PosSGenerateOutput
from .target_forward import prefill_batch, verify_batch

logger = logging.get_logger(__name__)


def batch_total_tokens(total_tokens: int, top_k: int, batch_size: int) -> int:
    """Tree nodes per row (root included) when ``batch_size`` rows are verified together.

    The verification forward carries ``batch_size * n`` tokens, so the single-row budget ``total_tokens`` is shared
    among the rows: ``n = max(top_k, total_tokens // batch_size)`` (never below one full depth-1 layer of ``top_k``
    children, never above ``total_tokens``, at least 2). ``batch_size`` counts the rows still generating.
    """
    return max(2, min(total_tokens, max(top_k, total_tokens // max(batch_size, 1))))


def make_batched_proposer(draft, depth: int, top_k: int, total_tokens: int):
    """The drafting object of the batched loop (tests replace it with scripted proposers)."""
    return PosSProposer(draft, depth=depth, top_k=top_k, total_tokens=total_tokens)


class _Rows:
    """Output sequences of all B rows and the per-row stopping logic, like stock batched ``generate``."""

    def __init__(self, input_ids, stopping_criteria, max_length: int, pad_token_id: int):
        batch, length = input_ids.shape
        self.ids = torch.full((batch, max(max_length, length)), pad_token_id, dtype=input_ids.dtype,
                              device=input_ids.device)  # fmt: skip
        self.ids[:, :length] = input_ids
        self.lengths = [length] * batch
        self.stopping_criteria = stopping_criteria
        self.max_length = max_length

    def prefix(self, row: int) -> torch.LongTensor:
        """`[1, L]` the row's sequence so far."""
        return self.ids[row : row + 1, : self.lengths[row]]

    def emit(self, row: int, tokens: list[int]) -> bool:
        """Append ``tokens`` to ``row`` until a stopping criterion fires; return whether the row finished."""
        for token in tokens:
            self.ids[row, self.lengths[row]] = token
            self.lengths[row] += 1
            if self.lengths[row] >= self.ids.shape[1] or bool(self.stopping_criteria(self.prefix(row), None).all()):
                return True
        return False

    def sequences(self) -> torch.LongTensor:
        return self.ids[:, : max(self.lengths)]


# processor attributes that hold one entry per batch row (sliced to the row for row-by-row acceptance)
BATCH_ATTRIBUTES = ("prompt_ignore_length",)


def row_processors(logits_processor, batch_size: int) -> list:
    """One processor list per row: batch-shaped state (e.g. the repetition penalty's per-row padding length) sliced
    to that row, so a processor sees a `[1, L]` row exactly as it sees that row inside the batch."""
    if logits_processor is None or len(logits_processor) == 0:
        return [identity_processor] * batch_size
    rows = []
    for b in range(batch_size):
        processors = []
        for processor in logits_processor:
            for name in BATCH_ATTRIBUTES:
                value = getattr(processor, name, None)
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == batch_size:
                    processor = copy.copy(processor)
                    setattr(processor, name, value[b : b + 1])
            processors.append(processor)
        rows.append(LogitsProcessorList(processors))
    return rows


def batched_tree_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, draft,
                          depth: int, top_k: int, total_tokens: int, model_kwargs: dict):  # fmt: skip
    """Tree speculation for ``input_ids`` `[B, T]` (B > 1): returns ``(sequences [B, T'], AcceptanceStats)``."""
    do_sample = bool(generation_config.do_sample)
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    layout = BatchLayout.from_attention_mask(attention_mask.to(input_ids.device))
    pad = pad_token_tensor(generation_config)
    rows = _Rows(input_ids, stopping_criteria, generation_config.max_length, 0 if pad is None else int(pad.item()))
    stats = AcceptanceStats()
    per_row = None  # processors per original row; None: vectorised greedy acceptance
    if do_sample or (logits_processor is not None and len(logits_processor) > 0):
        per_row = row_processors(logits_processor, input_ids.shape[0])
    cache = full_layer_cache()
    copied_tokens = context_tokens(draft, generation_config)
    row_total = batch_total_tokens(total_tokens, top_k, input_ids.shape[0])
    warping = sampled_tree_warping(draft, generation_config, copied_tokens > 0)  # sampled trees or None
    if warping is not None:
        proposer = SampledTreeProposer(draft, depth, top_k, row_total, warping)
    else:
        proposer = make_batched_proposer(draft, depth, top_k, row_total)
    context = ContextCandidates(copied_tokens) if copied_tokens > 0 else None  # continuations copied from the rows
    pads = (attention_mask == 0).sum(dim=1).tolist()  # left padding of each row, left out of its context

    feature_layers = draft.config.feature_layers  # features [B, T, k*H]: the target hidden states the draft reads
    logits, features = prefill_batch(model, input_ids, layout, cache, feature_layers)
    scores = logits_processor(input_ids, logits.float().to(input_ids.device))
    if do_sample:
        first = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)[:, 0]
    else:
        first = scores.argmax(dim=-1)
    active = torch.arange(input_ids.shape[0], device=input_ids.device)  # original row of each batch row
    finished = [rows.emit(b, [int(first[b])]) for b in range(input_ids.shape[0])]
    device = features.device
    proposer.append(torch.cat([input_ids[:, 1:], first[:, None]], 1).to(device), features,
                    layout.valid.to(device))  # fmt: skip
    layout = BatchLayout(layout.valid.to(device), layout.positions.to(device))

    while True:
        keep = [i for i, done in enumerate(finished) if not done]
        if not keep:
            break
        if len(keep) < len(finished):  # finished rows leave the batch
            kept = torch.tensor(keep, device=device)
            select_cache_rows(cache, kept)
            proposer.select_rows(kept)
            layout = layout.select_rows(kept)
            active = active[kept.to(active.device)]
            finished = [False] * len(keep)
            proposer.total_tokens = batch_total_tokens(total_tokens, top_k, len(keep))
        index = relayout_index(layout.valid)
        if index is not None:  # drop holes every row has
            gather_cache_columns(cache, index)
            proposer.relayout(index, layout.positions)
            layout = layout.gather(index)

        clock = time.perf_counter()
        budgets = torch.tensor([generation_config.max_length - rows.lengths[r] for r in active.tolist()], device=device)
        tree = proposer.propose_batch(layout.valid, layout.positions, depth=int(budgets.max()) - 1)
        if context is not None:
            contexts = [rows.ids[r, pads[r] : rows.lengths[r]] for r in active.tolist()]
            tree = context.extend(tree, contexts, proposer.total_tokens)
        tree = tree.limit_depth(budgets - 1)
        stats.add_time("drafting", time.perf_counter() - clock)

        clock = time.perf_counter()
        logits, features = verify_batch(model, tree, layout, cache, feature_layers)
        stats.add_time("verification", time.perf_counter() - clock)

        clock = time.perf_counter()
        prefixes = lambda: [rows.prefix(r) for r in active.tolist()]  # noqa: E731
        processors = None if per_row is None else [per_row[r] for r in active.tolist()]
        accepted = accept_batch(tree, logits.float(), prefixes, processors, do_sample)
        for b in range(accepted.counts.shape[0]):
            stats.record(int(accepted.counts[b]) - 1, bool(accepted.proposed_next[b]))
        if tree.sources is not None:  # context candidates: estimates and which source proposed the accepted tokens
            on_path = on_path_mask(tree.num_nodes, accepted.index.to(device), accepted.valid.to(device))
            context.observe(tree, on_path)
            for b in range(accepted.counts.shape[0]):
                stats.record_sources(tree.sources[b][on_path[b]][1:].tolist())
        stats.add_time("acceptance", time.perf_counter() - clock)

        clock = time.perf_counter()
        keep_accepted(cache, tree.num_nodes, accepted.index)
        layout = layout.append(accepted.counts.to(device), accepted.width)
        new_features = features.gather(1, accepted.index[..., None].expand(-1, -1, features.shape[-1]).to(device))
        proposer.append(accepted.tokens.to(device), new_features, accepted.valid.to(device))
        stats.add_time("cache_update", time.perf_counter() - clock)

        tokens = accepted.tokens.tolist()
        counts = accepted.counts.tolist()
        for b, r in enumerate(active.tolist()):
            finished[b] = rows.emit(r, tokens[b][accepted.width - counts[b] :])
    return rows.sequences(), stats


def _plain_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs):
    """The automatic budget with B > 1 rows on a CPU: transformers' own batched decoding for the whole call.

    Verifying B trees costs B times a single-row round on a CPU, so batched speculation was measured slower than plain
    batched `generate` (0.65-0.72x at batch sizes 2-8 on 2 cores); a fixed ``tree_total_tokens`` still speculates."""
    logger.info_once(f"batch size {input_ids.shape[0]}: the automatic budget decodes batches plainly on a CPU "
                     "(batched tree speculation is slower there than plain batched generate); a fixed "
                     "draft.generation_config.tree_total_tokens makes it speculate")
    stats = AcceptanceStats()
    stats.fell_back_to_plain = True
    start = time.perf_counter()
    out = sample(model, input_ids, logits_processor, stopping_criteria, generation_config, False, streamer,
                 **model_kwargs)
    stats.add_time("plain_decoding", time.perf_counter() - start)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    stats.record_plain_steps(sequences.shape[1] - input_ids.shape[1])
    if isinstance(out, torch.Tensor):
        return PosSGenerateOutput(sequences=out, acceptance=stats) if generation_config.return_dict_in_generate else out
    return PosSGenerateOutput(sequences=sequences, scores=out.scores, logits=out.logits, cache=out.cache,
                              acceptance=stats)


def generate_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, draft,
                   model_kwargs: dict):  # fmt: skip
    """`generate` with a PosS draft and B > 1 rows: sequences `[B, T']`, or a `PosSGenerateOutput`."""
    return_dict = generation_config.return_dict_in_generate
    if tree_shape(draft)[2] == "auto" and lm_head_device(model).type == "cpu":
        return _plain_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                            model_kwargs)  # fmt: skip
    if streamer is not None:
        raise ValueError("Streamers take one sequence: tree speculation with a streamer needs batch size 1.")
    if return_dict and (generation_config.output_scores or generation_config.output_logits):
        raise ValueError("output_scores / output_logits are supported with batch size 1 only for tree speculation.")
    depth, top_k, total = tree_shape(draft)
    if total == "auto":  # the measured budget is single-row; batches share the paper's default instead
        total = DEFAULT_TREE_SHAPE["tree_total_tokens"]
    place_draft(draft, model)
    sequences, stats = batched_tree_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                             draft, depth, top_k, total, model_kwargs)  # fmt: skip
    return PosSGenerateOutput(sequences=sequences, acceptance=stats) if return_dict else sequences
