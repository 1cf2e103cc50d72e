"""The draft side of a generation call: the tree shape, where the draft runs, and `PosSCandidateGenerator`."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..checks import tree_setting
from ..configuration_poss import DEFAULT_TREE_SHAPE
from ..modeling_poss import PosSDraftModel
from ..quantization.int8 import linear_device
from ..speculation.drafter import PosSProposer
from ..speculation.sampled_drafter import DraftWarping, SampledTreeProposer, sampled_trees_conflict, tree_sampling_mode
from ..speculation.tree import DraftTree
from .hybrid import ContextCandidates, context_candidate_tokens, drafting_depths

AUTO_MAX_NODES = 64  # upper bound on verified nodes with tree_total_tokens="auto"


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
    """(depth, top_k, total_tokens) from ``draft.generation_config``, defaulting to `DEFAULT_TREE_SHAPE`.

    ``total_tokens`` may be ``"auto"``: the number of verified nodes is then chosen every round from the measured
    cost curve of this machine (see `transformers_poss.generation.budget`).
    """
    config = getattr(draft, "generation_config", None)
    depth, top_k, total = (tree_setting(config, name, default) for name, default in DEFAULT_TREE_SHAPE.items())
    return depth, top_k, total


def lm_head_device(target) -> torch.device:
    """Where the target's lm_head runs: its accelerate execution device when dispatched/offloaded, else its weight's."""
    head = target.get_output_embeddings()
    device = getattr(getattr(head, "_hf_hook", None), "execution_device", None)
    if device is None:
        return linear_device(head)
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def place_draft(draft, target) -> torch.device:
    """Move the draft to the device of the target's lm_head and run it in the target's floating dtype (e.g. a draft
    stored in bf16 beside an fp32 target on a CPU; a quantized draft keeps its own); returns that device."""
    device = lm_head_device(target)
    try:
        current = next(draft.parameters()).device
    except (StopIteration, AttributeError):
        current = torch.device("cpu")
    if current != device:
        draft.to(device)
    dtype = getattr(target, "dtype", None)
    params = [p for p in draft.parameters() if p.is_floating_point()]
    quantized = getattr(draft, "_poss_quantized", None)
    if not quantized and dtype is not None and dtype.is_floating_point and params and params[0].dtype != dtype:
        draft.to(dtype)
    return device


def draws_sampled_trees(draft, generation_config) -> bool:
    """Whether this call samples its trees: ``do_sample`` and ``tree_sampling="draft_probabilities"`` on the draft's
    generation config (a bad ``tree_sampling`` value raises)."""
    mode = tree_sampling_mode(getattr(draft, "generation_config", None))
    return mode == "draft_probabilities" and generation_config is not None and bool(generation_config.do_sample)


def context_tokens(draft, generation_config) -> int:
    """Tokens per copied continuation for this call (0: no context candidates), see `context_candidate_tokens`."""
    return context_candidate_tokens(getattr(draft, "generation_config", None),
                                    sampled_trees=draws_sampled_trees(draft, generation_config))


def sampled_tree_warping(draft, generation_config, context: bool = False) -> DraftWarping | None:
    """The draft's warping when this call samples its trees (`draws_sampled_trees`), else None. A combination that
    chooses a node's children after drawing them (context candidates turned on explicitly) raises: the recursive
    rule would not be exact there."""
    if not draws_sampled_trees(draft, generation_config):
        return None
    conflict = sampled_trees_conflict(context)
    if conflict:
        raise ValueError(f'tree_sampling="draft_probabilities" cannot be combined with {conflict}: the tree is then '
                         "cut after its children are drawn, and the recursive rejection rule would no longer keep "
                         'the target distribution. Use tree_sampling="target_only" or turn it off.')
    return DraftWarping.from_generation_config(generation_config)


class PosSCandidateGenerator(CandidateGenerator):
    """A `CandidateGenerator` whose candidates are draft trees (single-row loop).

    It owns the draft's state across rounds (a `PosSProposer`, which keeps each specialist's KV cache of the accepted
    context), runs the draft on the device of the target's ``lm_head`` and, with ``tree_total_tokens="auto"``, the
    per-round node budget of this machine. With ``tree_context_candidates`` it grafts continuations copied from the
    context into every tree (`hybrid.ContextCandidates`).

    Args:
        draft (`PosSDraftModel`): the draft, attached to ``target``.
        target (`PreTrainedModel`): the model ``generate`` was called on.
        generation_config (`GenerationConfig`, *optional*): the call's; with ``do_sample`` and the draft's
            ``tree_sampling="draft_probabilities"`` the trees are sampled (`sampled_tree_warping`).
    """

    requires_model_outputs = True

    def __init__(self, draft, target, generation_config=None):
        self.draft = draft
        self.target = target
        self.depth, self.top_k, self.total_tokens = tree_shape(draft)
        self.device = place_draft(draft, target)
        tokens = context_tokens(draft, generation_config)
        self.context = ContextCandidates(tokens) if tokens > 0 else None
        self.warping = sampled_tree_warping(draft, generation_config, self.context is not None)
        self._setup_budget()
        self.proposer = self._make_proposer()

    def _make_proposer(self):
        if self.warping is not None:
            return SampledTreeProposer(self.draft, self.depth, self.top_k, self.total_tokens, self.warping)
        return PosSProposer(self.draft, depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens)

    def _setup_budget(self):
        """Round recording and, with ``tree_total_tokens="auto"``, the machine's speculation budget."""
        config = self.draft.generation_config
        self.record = bool(getattr(config, "tree_record_rounds", False))
        self.rounds = []
        self.budget = None
        self.fell_back = False
        if self.total_tokens == "auto":
            from .budget import TreeBudget, load_or_measure_profile

            self.total_tokens = tree_setting(config, "tree_max_total_tokens", AUTO_MAX_NODES)
            profile = load_or_measure_profile(self.target, self.draft, top_k=self.top_k)
            if self.warping is not None:  # sampled trees: the shape is chosen before drawing
                from .sampled_budget import SampledTreeBudget

                self.budget = SampledTreeBudget(profile, depth=self.depth, max_nodes=self.total_tokens,
                                                top_k=self.top_k, warmup_rounds=8)  # fmt: skip
            else:  # with context candidates the node scores are already calibrated per source (`SourceEstimates`)
                self.budget = TreeBudget(profile, depth=self.depth, max_nodes=self.total_tokens, warmup_rounds=8,
                                         calibrate=self.context is None, allow_no_draft=self.context is not None)
        self._plain_round = False  # this round is a plain step: a probe, a pause, or nothing drafted nor verified
        self._drafted = None  # depth drafted this round (None before the budget shaped a tree)
        self._pending = None  # context pairs not yet given to the draft (accepted during plain probes)

    def _shape_tree(self, tree: DraftTree) -> DraftTree:
        """With an automatic budget, keep the nodes worth verifying on this machine and set the next drafting depth
        (one level deeper than the depth kept, see `budget.TreeBudget.choose`)."""
        if self.budget is None or self.warping is not None:  # no budget, or a sampled tree shaped before drawing
            return tree
        drafted = self._drafted = getattr(self.proposer, "depth", self.depth)
        depths = tree.depths if tree.sources is None else drafting_depths(tree.as_batch())[0]  # copies: no drafting
        keep, _ = self.budget.choose(tree.scores, depths, drafted_depth=drafted)
        self.proposer.depth = self.budget.next_depth
        return tree.select(keep.to(tree.tokens.device))

    def falls_back(self, remaining: int | None = None) -> bool:
        """Whether the automatic budget has decided that speculation does not pay for the rest of the call.

        When it finds that speculation does not pay now, the budget first pauses it (`budget.TreeBudget.start_pause`:
        a stretch of plain rounds, then speculation again), as long as the pause is shorter than the ``remaining``
        tokens; otherwise (or when ``remaining`` is not given) the call is handed to plain decoding for good."""
        budget = self.budget
        if budget is not None and not self.fell_back and not budget.paused() and budget.should_fall_back():
            if remaining is not None and 0 < budget.next_pause() < remaining:
                budget.start_pause()
            else:
                self.fell_back = True
        return self.fell_back

    @property
    def pausing(self) -> bool:
        """Whether this round is part of a plain stretch the budget started (see `falls_back`)."""
        return self.budget is not None and self.budget.paused()

    def observe(self, tree: DraftTree, accepted) -> None:
        """Feed a verified round back: calibrates the automatic budget; records rounds when asked."""
        if self._plain_round:
            return
        if self.budget is not None and tree.num_nodes == 1 and self._drafted == 0:  # a plain step (observe_seconds)
            self._plain_round = True
            return
        if self.budget is not None and not self.fell_back:
            self.budget.observe(accepted.num_accepted)
            if self.warping is not None:
                self.budget.observe_tree(tree, accepted.path)
        if self.context is not None and tree.sources is not None:
            on_path = torch.zeros(1, tree.num_nodes, dtype=torch.bool, device=tree.tokens.device)
            on_path[0, accepted.path.to(on_path.device)] = True
            self.context.observe(tree.as_batch(), on_path)
        if self.record and tree.scores is not None:
            from .budget import RoundRecord

            self.rounds.append(RoundRecord(depths=tree.depths.cpu(), scores=tree.scores.cpu(),
                                           path=accepted.path.cpu(), parents=tree.parents.cpu()))

    PROFILE_TOLERANCE = 3.0  # profile shape vs measured: beyond this factor the cached profile is measured again
    PROFILE_CHECK_MIN_SECONDS = 0.01  # below this t(1), host work dominates the loop's timings: no check

    def check_profile(self) -> None:
        """At the end of a call: when the profile's cost shape or its one-token cost is far from what this call
        measured (plain probe rounds against drafted rounds), drop the cached profile so that the next call measures
        the machine as it is now."""
        if self.budget is None or self.budget.profile.verify(1) < self.PROFILE_CHECK_MIN_SECONDS:
            return
        shape, scale = self.budget.profile_error(), self.budget.plain_cost_error()
        reason = None
        if shape is not None and shape > self.PROFILE_TOLERANCE:
            reason = f"its t(n) / t(1) is {shape:.1f}x off what this call measured"
        elif scale is not None and scale > self.PROFILE_TOLERANCE:
            reason = f"its t(1) is {scale:.1f}x off the plain steps this call measured"
        if reason is not None:
            from .cost_profile import forget_profile

            forget_profile(self.budget.profile.key, reason)

    def observe_seconds(self, seconds: float, verify_seconds: float | None = None, nodes: int | None = None) -> None:
        """The measured wall time of the round just finished (drafting to cache update) and of its verification of
        ``nodes`` nodes, for the budget. A round with nothing drafted and nothing to verify (a plain probe, or a
        root-only tree when the budget chose to draft nothing and the context offered nothing) is timed as the plain
        step it is, so rounds that do not speculate never count as speculation that did not pay; a round that drafted
        and then kept only the root paid for drafting, and counts as speculation."""
        if self.budget is None or self.fell_back:
            return
        if self._plain_round:
            self.budget.observe_plain(seconds, verify_seconds)
        else:
            self.budget.observe_seconds(seconds, verify_seconds, nodes)

    def get_candidates(
        self, input_ids: torch.LongTensor, new_tokens: torch.LongTensor = None, new_features: torch.Tensor = None
    ) -> tuple[DraftTree, None]:
        """Draft a tree rooted at the last token of ``input_ids``.

        Args:
            input_ids (`torch.LongTensor` of shape `[1, T]`): the sequence so far; its last token is the root.
            new_tokens (`torch.LongTensor` of shape `[1, m]`): tokens x_{t+1} of the context pairs accepted since the
                previous call (the last one is the root).
            new_features (`torch.Tensor` of shape `[1, m, k*H]`): the target features f_t of the same pairs (k*H =
                ``draft.config.target_feature_size``).

        Returns:
            `(tree, None)`: the tree on the device of ``input_ids``; no candidate logits (the draft is deterministic).
        """
        if self.fell_back:  # the loop hands over to plain decoding; a root-only tree is a plain step
            return DraftTree.root_only(input_ids[0, -1]), None
        new_tokens, new_features = new_tokens.to(self.device), new_features.to(self.device)
        if self._pending is not None:  # pairs accepted during plain probes: the draft reads them now
            new_tokens = torch.cat([self._pending[0], new_tokens], dim=1)
            new_features = torch.cat([self._pending[1], new_features], dim=1)
            self._pending = None
        self._plain_round = self.budget is not None and (self.budget.paused() or self.budget.plain_probe_due())
        if self._plain_round:  # one plain decoding step, timed: what a step costs here now (budget.measured_speedup)
            self._pending = (new_tokens, new_features)
            return DraftTree.root_only(input_ids[0, -1]), None
        if self.budget is not None and self.warping is not None:  # sampled: the shape is fixed before drawing
            self._drafted, self.proposer.total_tokens = self.budget.choose_shape()
            self.proposer.depth = self._drafted
        tree = self.proposer.propose(new_tokens, new_features)
        if self.context is not None:
            tree = self.context.extend_single(tree, input_ids[0], self.total_tokens)
        return self._shape_tree(tree).to(input_ids.device), None
