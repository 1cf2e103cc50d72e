"""One tree from two sources: the draft's tree and continuations copied from the context, with per-source estimates.

With ``draft.generation_config.tree_context_candidates`` on (the default; ``False`` reproduces the paper), every
round:

1. the draft drafts its tree as usual;
2. below every node of it (the root included) the context (prompt + generated tokens) is searched for the longest
   earlier occurrence of the node's suffix (`speculation.context_match`, 2 to 3 tokens), and the tokens that
   followed it are grafted below the node (`speculation.trie.graft_chains`): a copied token equal to a drafted child
   reuses that node, so a shared prefix is verified once and siblings never repeat a token;
3. every node gets an estimated probability of being accepted from the source(s) that proposed it
   ([`SourceEstimates`], learned online from the rounds of the call): the draft's own conditional probability times
   its calibration, or the copied source's observed rate at the node's position in its continuation (the first
   token, the second, ...); a node proposed by both takes the higher. Estimates multiply down a path, so a child never
   outranks its parent;
4. the merged tree is cut to the node budget by that estimate: ``tree_total_tokens`` nodes (so copied tokens take
   nodes only where they rank above drafted ones, within the same total), or with ``"auto"`` the automatic budget
   chooses (`budget.TreeBudget`, on the same estimates, copied nodes costing no drafting time).

Acceptance is unchanged: a node's children are deterministic proposals, whichever source they come from.
"""

from __future__ import annotations

import torch

from ..speculation.context_match import context_continuations
from ..speculation.tree import BatchedTree, DraftTree
from ..speculation.trie import (CHAIN_START, CONTEXT_SOURCE, DRAFT_SOURCE, POSITION_SHIFT, SHORT_MATCH, chain_position,
                                graft_chains, keep_nodes)

DEFAULT_CONTEXT_TOKENS = 10  # tokens per copied continuation with ``tree_context_candidates=True``
CONTEXT_MAX_NGRAM = 3  # longest suffix looked up in the context
CONTEXT_MIN_NGRAM = 2  # shortest suffix accepted as a match below a drafted node
CONTEXT_ROOT_MIN_NGRAM = 1  # ... and at the root (a 1-token match there has its own acceptance rate)


def context_candidate_tokens(config, sampled_trees: bool = False) -> int:
    """``generation_config.tree_context_candidates`` as the length of a copied continuation (0: off).

    Unset (``None``): on, `DEFAULT_CONTEXT_TOKENS`, except for a call that samples its trees from the draft
    (``sampled_trees``: ``tree_sampling="draft_probabilities"``), which cannot cut a tree after drawing it; ``False`` /
    ``0``: off (the paper's setting); ``True``: `DEFAULT_CONTEXT_TOKENS`; an int ``>= 1``: that many tokens per
    continuation. Anything else raises a ``ValueError``.
    """
    value = getattr(config, "tree_context_candidates", None)
    if value is None:
        return 0 if sampled_trees else DEFAULT_CONTEXT_TOKENS
    if value is False:
        return 0
    if value is True:
        return DEFAULT_CONTEXT_TOKENS
    if isinstance(value, int) and value >= 0:
        return int(value)
    raise ValueError(f"`tree_context_candidates` must be True, False or an integer >= 0 (tokens per copied "
                     f"continuation), got {value!r}.")


def _per_level(parents: torch.LongTensor, depths: torch.LongTensor, value: torch.Tensor, step) -> torch.Tensor:
    """Fill ``value`` (`[B, n]`, roots set) level by level: ``value[i] = step(value[parents[i]])`` at depth >= 1.
    Loops over depth, never over nodes."""
    for depth in range(1, int(depths.max()) + 1 if depths.numel() else 1):
        level = depths == depth
        value = torch.where(level, step(value.gather(1, parents.clamp(min=0))), value)
    return value


def drafting_depths(tree: BatchedTree) -> torch.LongTensor:
    """`[B, n]`: the draft depth a node needs: its depth for a node only the draft proposed, its parent's for a node
    copied from the context (it costs no drafting time). Never above the parent's, so a prefix of a score ranking
    restricted to ``<= d`` is still a tree."""
    sources = tree.sources
    drafted_only = (sources & CONTEXT_SOURCE) == 0
    need = torch.zeros_like(tree.depths)
    for depth in range(1, int(tree.depths.max()) + 1):
        level = tree.depths == depth
        inherited = need.gather(1, tree.parents.clamp(min=0))
        need = torch.where(level, torch.where(drafted_only, tree.depths, inherited), need)
    return need


class SourceEstimates:
    """Online acceptance estimates of the two sources over the rounds of one call.

    - draft: a calibration factor, accepted draft nodes over the sum of the draft's conditional probabilities of the
      draft nodes that were tried (whose parent was accepted);
    - context: the share of tried copied nodes that were accepted: for the first token of a continuation (one rate
      where the continuation was found by matching two or more tokens, one where a single token matched), and for
      each later position of it. Once a copy is right it tends to stay right (a span of the prompt is being
      repeated), so the rate at position 8 is usually well above the one at position 2; a later position's rate
      starts from the pooled rate of all later positions and moves to its own as its observations come in.

    Each starts from a small prior (two pseudo-observations; a later position's own rate from ``step_prior_weight``).
    """

    MAX_STEPS = 64  # positions beyond this share the last one's rate

    def __init__(self, prior_weight: float = 2.0, first_rate: float = 0.3, next_rate: float = 0.85,
                 step_prior_weight: float = 2.0, short_first_rate: float = 0.15):
        self.draft = [prior_weight, prior_weight]  # accepted, predicted
        self.first = [prior_weight * first_rate, prior_weight]  # accepted, tried
        self.short_first = [prior_weight * short_first_rate, prior_weight]  # after a single-token match
        self.next = [prior_weight * next_rate, prior_weight]  # pooled over positions >= 2
        self.step_prior_weight = step_prior_weight
        self.step_counts = torch.zeros(2, self.MAX_STEPS + 1, dtype=torch.float64)  # accepted, tried per position

    @property
    def draft_calibration(self) -> float:
        return self.draft[0] / self.draft[1]

    @property
    def first_rate(self) -> float:
        return self.first[0] / self.first[1]

    @property
    def short_first_rate(self) -> float:
        return self.short_first[0] / self.short_first[1]

    @property
    def next_rate(self) -> float:
        return self.next[0] / self.next[1]

    def step_rates(self) -> torch.Tensor:
        """`[MAX_STEPS + 1]` estimated acceptance of a copied token at each position (index 0 unused, 1: first)."""
        accepted, tried = self.step_counts
        weight = self.step_prior_weight
        rates = (accepted + weight * self.next_rate) / (tried + weight)
        rates[:2] = self.first_rate
        return rates

    def node_log_estimates(self, tree: BatchedTree, sources: torch.LongTensor,
                           draft_logprobs: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """`[B, n]` log of the estimated probability that each node is accepted (root 0; invalid nodes -inf)."""
        calibrated = (draft_logprobs.double() + torch.log(torch.tensor(self.draft_calibration))).clamp(max=0.0)
        steps = chain_position(sources).clamp(max=self.MAX_STEPS)
        copied = self.step_rates().to(steps.device).log()[steps]
        copied = torch.where((sources & SHORT_MATCH) > 0, torch.tensor(self.short_first_rate).log(), copied)
        minus_inf = torch.full_like(calibrated, float("-inf"))
        own = torch.maximum(torch.where((sources & DRAFT_SOURCE) > 0, calibrated, minus_inf),
                            torch.where((sources & CONTEXT_SOURCE) > 0, copied, minus_inf))
        start = torch.zeros_like(calibrated)
        estimates = _per_level(tree.parents, tree.depths, start, lambda parent: parent + own)
        return estimates.masked_fill(~tree.valid, float("-inf"))

    def observe(self, tree: BatchedTree, on_path: torch.BoolTensor) -> None:
        """Update the estimates with a verified round: ``on_path`` (`[B, n]`) marks the accepted nodes (roots
        included); a node was tried when its parent was accepted."""
        if tree.sources is None:
            return
        tried = on_path.gather(1, tree.parents.clamp(min=0)) & tree.valid
        tried[:, 0] = False
        drafted = tried & ((tree.sources & DRAFT_SOURCE) > 0)
        self.draft[0] += float((drafted & on_path).sum())
        self.draft[1] += float(tree.draft_logprobs.double().exp()[drafted].sum())
        copied = tried & ((tree.sources & CONTEXT_SOURCE) > 0)
        start = (tree.sources & CHAIN_START) > 0
        short = (tree.sources & SHORT_MATCH) > 0
        for counts, kind in ((self.first, copied & start & ~short), (self.short_first, copied & short),
                             (self.next, copied & ~start)):
            counts[0] += float((kind & on_path).sum())
            counts[1] += float(kind.sum())
        later = copied & ~start
        steps = chain_position(tree.sources).clamp(max=self.MAX_STEPS)[later].cpu()
        size = self.MAX_STEPS + 1
        self.step_counts[0] += torch.bincount(steps[on_path[later].cpu()], minlength=size).double()
        self.step_counts[1] += torch.bincount(steps, minlength=size).double()


def conditional_logprobs(tree: BatchedTree) -> torch.Tensor:
    """`[B, n]` the draft's log-probability of each node given its parent (scores are cumulative; 0 without)."""
    if tree.scores is None:
        return torch.zeros(tree.tokens.shape, device=tree.tokens.device)
    return tree.scores - tree.scores.gather(1, tree.parents.clamp(min=0)) * (tree.parents >= 0)


class ContextCandidates:
    """Extends the draft's trees with continuations copied from the context, for B >= 1 rows.

    Args:
        num_tokens: tokens per copied continuation (``tree_context_candidates``).
        max_ngram, min_ngram: longest / shortest suffix looked up in the context.
        root_min_ngram: shortest suffix accepted at the root (a single token: one more continuation at the root,
            where no drafted path competes; not below every drafted node, whose continuations would then cost more
            to merge than they bring).
    """

    def __init__(self, num_tokens: int, max_ngram: int = CONTEXT_MAX_NGRAM, min_ngram: int = CONTEXT_MIN_NGRAM,
                 root_min_ngram: int = CONTEXT_ROOT_MIN_NGRAM):
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.root_min_ngram = root_min_ngram
        self.estimates = SourceEstimates()

    def merge(self, tree: BatchedTree, contexts: list[torch.LongTensor]) -> BatchedTree:
        """The draft's trees (`[B, n]`) with every row's context continuations grafted in (tree_mask not built)."""
        batch = tree.tokens.shape[0]
        mask = tree.tree_mask
        chains, valid, matches = [], [], []
        for b in range(batch):
            found = context_continuations(contexts[b], tree.tokens[b], tree.depths[b], mask[b], self.num_tokens,
                                          self.max_ngram, self.min_ngram, self.root_min_ngram)  # fmt: skip
            chains.append(found.tokens)
            valid.append(found.valid & tree.valid[b][:, None])
            matches.append(found)
        anchors = torch.arange(tree.num_nodes, device=tree.tokens.device)[None].expand(batch, -1)
        merged = graft_chains(tree, anchors, torch.stack(chains), torch.stack(valid))
        base = merged.base_index
        logprobs = conditional_logprobs(tree)
        draft_logprobs = torch.where(base >= 0, logprobs.gather(1, base.clamp(min=0)), 0.0)
        starts = merged.chain_step == 1
        matched = torch.stack([found.lengths for found in matches]).to(base.device)  # [B, n] per anchor (base node)
        width = merged.tree.num_nodes
        matched = torch.cat([matched, matched.new_zeros(batch, width - matched.shape[1])], dim=1)
        short = starts & (matched.gather(1, merged.tree.parents.clamp(min=0)) == 1)
        sources = (merged.sources | torch.where(starts, CHAIN_START, 0) | torch.where(short, SHORT_MATCH, 0)
                   | (merged.chain_step << POSITION_SHIFT))
        out = merged.tree
        out.sources, out.draft_logprobs = sources, draft_logprobs
        return out

    def extend(self, tree: BatchedTree, contexts: list[torch.LongTensor], max_nodes: int) -> BatchedTree:
        """Merge the continuations in, estimate every node, keep the ``max_nodes - 1`` best nodes per row (+ root).

        Args:
            tree: the draft's trees, `[B, n]` with cumulative ``scores``.
            contexts: per row, `[L_b]` the row's tokens so far (no padding), its root last.
            max_nodes: nodes per row, root included.

        Returns:
            a `BatchedTree` with ``scores`` = log estimated acceptance, ``sources`` and ``draft_logprobs``.
        """
        merged = self.merge(tree, contexts)
        estimates = self.estimates.node_log_estimates(merged, merged.sources, merged.draft_logprobs)
        batch, n = estimates.shape
        ranking = torch.sort(estimates[:, 1:], dim=1, descending=True, stable=True).indices  # [B, n - 1]
        places = torch.arange(n - 1, device=ranking.device).expand(batch, -1)
        rank = torch.empty_like(ranking).scatter_(1, ranking, places)  # rank of node i + 1 among the non-root nodes
        keep = torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=rank.device),
                          (rank < max_nodes - 1) & merged.valid[:, 1:]], dim=1)  # fmt: skip
        kept, scores, sources, logprobs = keep_nodes(merged, keep, estimates.float(), merged.sources,
                                                     merged.draft_logprobs)  # fmt: skip
        kept.scores, kept.sources, kept.draft_logprobs = scores, sources, logprobs
        return kept

    def extend_single(self, tree: DraftTree, context: torch.LongTensor, max_nodes: int) -> DraftTree:
        """`extend` for one row: a `DraftTree` in, a `DraftTree` out."""
        return self.extend(tree.as_batch(), [context], max_nodes).single()

    def observe(self, tree: BatchedTree, on_path: torch.BoolTensor) -> None:
        self.estimates.observe(tree, on_path)


def on_path_mask(num_nodes: int, index: torch.LongTensor, valid: torch.BoolTensor | None = None) -> torch.BoolTensor:
    """`[B, n]` True at the accepted nodes ``index`` (`[B, m]`; ``valid`` `[B, m]` marks real columns)."""
    mask = torch.zeros(index.shape[0], num_nodes, dtype=torch.bool, device=index.device)
    mask.scatter_(1, index, True if valid is None else valid)
    mask[:, 0] = True
    return mask
