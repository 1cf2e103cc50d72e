"""Tree speculative decoding inside the stock ``target.generate(assistant_model=draft)``.

``generate`` routes ``assistant_model=...`` to ``GenerationMixin._assisted_decoding``, which verifies one linear
chain. `enable_tree_generation` (called on ``import transformers_poss``) wraps that method and
``_validate_generation_mode`` so that a `PosSDraftModel` assistant runs the tree loop of this module, and any other
assistant (a small LM, prompt lookup, ...) keeps the stock path untouched. `disable_tree_generation` restores the
original methods.

Each round of the loop:
1. `PosSCandidateGenerator` drafts a tree from the context pairs accepted since the previous round;
2. ONE target forward over the tree nodes (4D tree mask, position = context length + depth) gives logits and the
   post-norm features; a chain (``tree_top_k=1``) goes through the plain causal path (2D mask) instead;
3. `verification.accept_tree` picks the accepted path (greedy or rejection sampling after the same logits processors
   ``generate`` applies);
4. `kv_cache.compact_cache` keeps only the accepted rows; the emitted tokens are appended one at a time through the
   stopping criteria, so generation stops exactly where plain ``generate`` would.

With ``tree_total_tokens="auto"`` a fallback decided by the budget hands the rest of the call to transformers' own
decoding loop (`handover.continue_with_stock_loop`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from .emitter import Emitter, first_token
from .handover import continue_with_stock_loop
from .kv_cache import (
    compact_cache,
    finish_cache_after_tree,
    prepare_cache_for_tree,
    tree_verification_mask,
)
from .modeling_poss import PosSDraftModel
from .quantize import linear_device
from .tree import DraftTree
from .validation import check_generation_config, check_inputs
from .verification import AcceptanceStats, accept_tree

DEFAULT_TREE_SHAPE = {"tree_depth": 6, "tree_top_k": 10, "tree_total_tokens": 60}
AUTO_MAX_NODES = 64  # upper bound on verified nodes with tree_total_tokens="auto"


@dataclass
class PosSGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` with the acceptance statistics of tree speculative decoding.

    Args:
        acceptance (`AcceptanceStats`): per-round acceptance lengths, position-wise acceptance and phase timings.
    """

    acceptance: AcceptanceStats | None = None


def tree_draft_of(model) -> PosSDraftModel | None:
    """The PosS draft behind ``model``: the model itself, or the draft inside a peft ``PeftModel`` (adapters stay
    active, they are injected into the draft's own layers); None for any other assistant."""
    if isinstance(model, PosSDraftModel):
        return model
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and type(model).__module__.startswith("peft"):
        base = get_base_model()
        if isinstance(base, PosSDraftModel):
            return base
    return None


def is_tree_draft(model) -> bool:
    """Whether ``model`` is a PosS draft (or a PeftModel around one), i.e. ``generate`` runs tree speculation."""
    return tree_draft_of(model) is not None


def tree_shape(draft) -> tuple[int, int, int | str]:
    """(depth, top_k, total_tokens) from ``draft.generation_config``, with the paper's defaults 6 / 10 / 60.

    ``total_tokens`` may be ``"auto"``: the number of verified nodes is then chosen every round from the measured
    cost curve of this machine (see `transformers_poss.budget`).
    """
    config = getattr(draft, "generation_config", None)
    values = [getattr(config, name, None) or default for name, default in DEFAULT_TREE_SHAPE.items()]
    auto = values[2] == "auto"
    depth, top_k = int(values[0]), int(values[1])
    total = "auto" if auto else int(values[2])
    if depth < 1 or top_k < 1 or (not auto and total < 2):
        raise ValueError(f"invalid tree shape: depth={depth}, top_k={top_k}, total_tokens={total}")
    return depth, top_k, total


class PosSCandidateGenerator(CandidateGenerator):
    """A `CandidateGenerator` whose candidates are draft trees.

    It owns the draft's state across rounds (a `PosSProposer`, which keeps each specialist's KV cache of the accepted
    context) and runs the draft on the device of the target's ``lm_head``.

    Args:
        draft (`PosSDraftModel`): the draft, attached to ``target`` (attached here when it is not yet).
        target (`PreTrainedModel`): the model ``generate`` was called on.
    """

    requires_model_outputs = True

    def __init__(self, draft, target):
        self.draft = draft
        self.target = target
        self.depth, self.top_k, self.total_tokens = tree_shape(draft)
        self.device = _lm_head_device(target)
        if _draft_device(draft) != self.device:
            draft.to(self.device)
        _match_dtype(draft, target)
        self._setup_budget()
        self.proposer = self._make_proposer()

    def _setup_budget(self):
        """Round recording and, with ``tree_total_tokens="auto"``, the machine's speculation budget."""
        config = self.draft.generation_config
        self.record = bool(getattr(config, "tree_record_rounds", False))
        self.rounds = []
        self.budget = None
        self.fell_back = False
        if self.total_tokens == "auto":
            from .budget import TreeBudget, load_or_measure_profile

            self.total_tokens = int(getattr(config, "tree_max_total_tokens", None) or AUTO_MAX_NODES)
            profile = load_or_measure_profile(self.target, self.draft, top_k=self.top_k)
            self.budget = TreeBudget(profile, depth=self.depth, max_nodes=self.total_tokens)

    def _make_proposer(self):
        from .proposer import PosSProposer

        return PosSProposer(self.draft, depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens)

    def _shape_tree(self, tree: DraftTree) -> DraftTree:
        """With an automatic budget, keep the nodes worth verifying on this machine and set the next drafting depth
        (one level deeper than the depth kept, see `budget.TreeBudget.choose`)."""
        if self.budget is None:
            return tree
        drafted = getattr(self.proposer, "depth", self.depth)
        keep, _ = self.budget.choose(tree.scores, tree.depths, drafted_depth=drafted)
        self.proposer.depth = self.budget.next_depth
        return tree.select(keep.to(tree.tokens.device))

    def falls_back(self) -> bool:
        """Whether the automatic budget has decided that speculation does not pay for the rest of the call."""
        if self.budget is not None and not self.fell_back and self.budget.should_fall_back():
            self.fell_back = True
        return self.fell_back

    def observe(self, tree: DraftTree, accepted) -> None:
        """Feed a verified round back: calibrates the automatic budget; records rounds when asked."""
        if self.budget is not None and not self.fell_back:
            self.budget.observe(accepted.num_accepted)
        if self.record and tree.scores is not None:
            from .budget import RoundRecord

            self.rounds.append(RoundRecord(depths=tree.depths.cpu(), scores=tree.scores.cpu(),
                                           path=accepted.path.cpu(), parents=tree.parents.cpu()))

    def get_candidates(
        self, input_ids: torch.LongTensor, new_tokens: torch.LongTensor = None, new_features: torch.Tensor = None
    ) -> tuple[DraftTree, None]:
        """Draft a tree rooted at the last token of ``input_ids``.

        Args:
            input_ids (`torch.LongTensor` of shape `[1, T]`): the sequence so far; its last token is the root.
            new_tokens (`torch.LongTensor` of shape `[1, m]`): tokens x_{t+1} of the context pairs accepted since the
                previous call (the last one is the root).
            new_features (`torch.Tensor` of shape `[1, m, H]`): the target features f_t of the same pairs.

        Returns:
            `(tree, None)`: the tree on the device of ``input_ids``; no candidate logits (the draft is deterministic).
        """
        if self.falls_back():  # the loop hands over to plain decoding; a root-only tree is a plain step
            return DraftTree.root_only(input_ids[0, -1]), None
        tree = self.proposer.propose(new_tokens.to(self.device), new_features.to(self.device))
        return self._shape_tree(tree).to(input_ids.device), None


def _lm_head_device(target) -> torch.device:
    """Where the target's lm_head runs: its accelerate execution device when dispatched/offloaded, else its weight's."""
    head = target.get_output_embeddings()
    device = getattr(getattr(head, "_hf_hook", None), "execution_device", None)
    if device is None:
        return linear_device(head)
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _match_dtype(draft, target) -> None:
    """Run the draft in the target's floating dtype (e.g. a draft stored in bf16 beside an fp32 target on a CPU)."""
    dtype = getattr(target, "dtype", None)
    params = [p for p in draft.parameters() if p.is_floating_point()]
    if getattr(draft, "_poss_quantized", None):
        return
    if dtype is not None and dtype.is_floating_point and params and params[0].dtype != dtype:
        draft.to(dtype)


def _draft_device(draft) -> torch.device:
    try:
        return next(draft.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def limit_tree_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """The subtree of nodes at depth ``<= max_depth`` (parents stay before children, so it is still a tree)."""
    keep = tree.depths <= max_depth
    return tree if bool(keep.all()) else tree.select(keep)


def _mask_dtype(model) -> torch.dtype | None:
    return None if model.config._attn_implementation in ("sdpa", "poss_exact") else model.dtype


def chain_attention_mask(num_nodes: int, context_mask: torch.BoolTensor | None) -> torch.LongTensor | None:
    """The 2D mask of a chain verified on the plain causal path: the context mask then ones, `[1, past + n]`
    (None without padding). transformers builds the causal / sliding-window mask from it as in plain decoding."""
    if context_mask is None:
        return None
    return torch.cat([context_mask.long(), context_mask.new_ones(num_nodes, dtype=torch.long)])[None]


def _verify(model, tree: DraftTree, cache, root_position: int, context_mask):
    """ONE target forward over the tree nodes: logits `[n, vocab]` and post-norm features `[n, H]`.

    A chain (top-k 1, or a tree cut to one path) is a plain continuation: it goes through the ordinary causal path
    (2D mask, transformers builds its own causal mask); any other tree gets the 4D tree mask.
    """
    device = model.device
    if tree.is_chain:
        mask = chain_attention_mask(tree.num_nodes, context_mask)
        mask = None if mask is None else mask.to(device)
    else:
        mask = tree_verification_mask(
            cache, model.config.get_text_config(), tree.tree_mask, tree.depths, context_mask, _mask_dtype(model)
        )
        mask = {k: v.to(device) for k, v in mask.items()} if isinstance(mask, dict) else mask.to(device)
    kwargs = {"logits_to_keep": 0} if model._supports_logits_to_keep() else {}
    outputs = model(
        input_ids=tree.tokens[None].to(device),
        attention_mask=mask,
        position_ids=(tree.depths + root_position)[None].to(device),
        cache=cache,
        use_cache=True,
        output_hidden_states=True,
        return_dict=True,
        **kwargs,
    )
    return outputs.logits[0], outputs.hidden_states[-1][0]


def _tree_assisted_decoding(
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
        from .batched_generation import generate_batch

        return generate_batch(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                              assistant_model, model_kwargs)  # fmt: skip
    candidate_generator = PosSCandidateGenerator(assistant_model, self)
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

    # prefill: last-position logits and every prompt position's features in the same forward
    outputs = self._prefill(input_ids, generation_config, {**model_kwargs, "output_hidden_states": True})
    new_features = outputs.hidden_states[-1]
    if new_features.shape[1] != input_ids.shape[1]:
        raise ValueError("Tree speculative decoding needs the features of the whole prompt: unset prefill_chunk_size.")
    prepare_cache_for_tree(cache)
    logits = outputs.logits[:, -1].to(dtype=torch.float32, device=input_ids.device)
    del outputs
    token, scores = first_token(logits, input_ids, logits_processor, do_sample)
    emitter.emit(token, scores, logits)
    new_tokens = torch.cat([input_ids[:, 1:], token[:, None]], dim=-1)

    while not emitter.finished and not candidate_generator.falls_back():
        clock = time.perf_counter()
        tree, _ = candidate_generator.get_candidates(emitter.input_ids, new_tokens, new_features)
        budget = generation_config.max_length - emitter.input_ids.shape[1]
        tree = limit_tree_depth(tree, max(budget - 1, 0))
        stats.add_time("drafting", time.perf_counter() - clock)

        clock = time.perf_counter()
        past_length = cache.get_seq_length()
        root_position = past_length if context_mask is None else int(context_mask.sum().item())
        logits, features = _verify(self, tree, cache, root_position, context_mask)
        logits = logits.to(dtype=torch.float32, device=input_ids.device)
        stats.add_time("verification", time.perf_counter() - clock)

        clock = time.perf_counter()
        accepted = accept_tree(tree, logits, emitter.input_ids, logits_processor, do_sample)
        stats.record(accepted.num_accepted, accepted.proposed_next, depth=tree.max_depth)
        candidate_generator.observe(tree, accepted)
        stats.add_time("acceptance", time.perf_counter() - clock)

        clock = time.perf_counter()
        compact_cache(cache, tree.num_nodes, accepted.path)
        if context_mask is not None:
            context_mask = torch.cat([context_mask, context_mask.new_ones(accepted.path.shape[0])])
        stats.add_time("cache_update", time.perf_counter() - clock)

        emitter.emit(accepted.tokens, accepted.scores, logits[accepted.path])
        new_tokens = accepted.tokens[None]
        new_features = features[accepted.path.to(features.device)][None]

    stats.rounds = candidate_generator.rounds
    stats.fell_back_to_plain = candidate_generator.fell_back
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


_ORIGINALS: dict[str, object] = {}


def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                       streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None,
                       tokenizer=None, **model_kwargs):  # fmt: skip
    """`GenerationMixin._assisted_decoding`, routed to the tree loop when the assistant is a PosS draft."""
    draft = tree_draft_of(assistant_model)
    method = _ORIGINALS["_assisted_decoding"] if draft is None else _tree_assisted_decoding
    assistant_model = assistant_model if draft is None else draft
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


def enable_tree_generation() -> None:
    """Make ``generate(assistant_model=<PosS draft>)`` run tree speculation (idempotent; done on import)."""
    for name, patch in _PATCHES.items():
        current = GenerationMixin.__dict__[name]
        if current is patch:
            continue
        _ORIGINALS[name] = current
        setattr(GenerationMixin, name, patch)


def disable_tree_generation() -> None:
    """Restore transformers' own assisted decoding (a PosS draft then fails in the stock validation)."""
    for name, original in list(_ORIGINALS.items()):
        if GenerationMixin.__dict__.get(name) is _PATCHES[name]:
            setattr(GenerationMixin, name, original)
        del _ORIGINALS[name]


install_generation_hook = enable_tree_generation
uninstall_generation_hook = disable_tree_generation


def is_tree_generation_enabled() -> bool:
    return all(GenerationMixin.__dict__.get(name) is patch for name, patch in _PATCHES.items())
