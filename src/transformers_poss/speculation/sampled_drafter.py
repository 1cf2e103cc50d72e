"""Sampled draft trees for ``tree_sampling="draft_probabilities"``: children drawn without replacement from the draft.

With the default ``"target_only"`` rule the children of a node are the draft's deterministic top-k, each verified as
a proposal of probability 1 (`acceptance.rejection_sample_children`). With ``"draft_probabilities"`` (sampling only;
greedy decoding keeps the deterministic tree) the drafter draws the children of every expanded node WITHOUT
replacement from the draft's distribution ``q`` (Gumbel-top-k over the draft's logits after the temperature / top-k /
top-p of the call, `DraftWarping`), and records ``q`` so that verification can run the recursive rule with ``p`` and
``q`` (`rejection.recursive_rejection_sample`).

That rule is exact only if the number of children a node gets does not depend on that node's own draws. EAGLE-2's
final re-ranking (keep the best ``n - 1`` nodes by cumulative score) would break it: whether a sampled child is kept
would depend on its own probability. So the shape is chosen level by level BEFORE drawing:

- the level sizes are fixed by (depth, top_k, total_tokens) (`level_sizes`);
- the children slots of level ``d + 1`` go to the frontier nodes of level ``d`` by the slot estimate
  ``score(node) + log q_node(i-th most likely token)``, known before drawing (a prefix of each node's draws: the
  slot estimates fall with ``i``);
- the frontier (the nodes expanded next) is the best ``top_k`` of the new level by their drawn cumulative score,
  which only decides which nodes get children later, never which siblings exist.
"""

from __future__ import annotations

import torch

from .drafter import PosSProposer, _RoundState
from .rejection import gumbel_top_k
from .tree import BatchedTree, DraftTree, batched_ancestor_mask

TREE_SAMPLING_MODES = ("target_only", "draft_probabilities")
DEFAULT_TREE_SAMPLING = "target_only"


def tree_sampling_mode(config) -> str:
    """``config.tree_sampling`` checked: one of `TREE_SAMPLING_MODES` (unset: `DEFAULT_TREE_SAMPLING`)."""
    value = getattr(config, "tree_sampling", None)
    if value is None:
        return DEFAULT_TREE_SAMPLING
    if value not in TREE_SAMPLING_MODES:
        raise ValueError(f"`tree_sampling` must be one of {', '.join(repr(m) for m in TREE_SAMPLING_MODES)} "
                         f"(how sampled trees are drafted and verified), got {value!r}.")
    return value


def sampled_trees_conflict(context: bool) -> str | None:
    """The setting that rules ``"draft_probabilities"`` out for a call, or None: context candidates (the merged tree
    is cut by estimated acceptance after its children are drawn). The automatic budget is compatible: it chooses a
    sampled tree's shape before drawing (`generation.sampled_budget`)."""
    return "tree_context_candidates" if context else None


class DraftWarping:
    """The temperature / top-k / top-p of a ``generate`` call, applied to the draft's logits (same semantics as
    transformers' warpers: temperature first, then top-k, then top-p keeping at least one token).

    Exactness never depends on these (any ``q`` the children are drawn from is verified exactly); they bring ``q``
    close to the target's processed ``p``, which is what makes children accepted.
    """

    def __init__(self, temperature: float | None = 1.0, top_k: int | None = None, top_p: float | None = None):
        self.temperature = 1.0 if not temperature else float(temperature)
        self.top_k = int(top_k) if top_k else None
        self.top_p = float(top_p) if top_p is not None and top_p < 1.0 else None

    @classmethod
    def from_generation_config(cls, config) -> "DraftWarping":
        return cls(getattr(config, "temperature", None), getattr(config, "top_k", None), getattr(config, "top_p", None))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities `[..., V]` of `[..., V]` logits (``-inf`` outside the kept tokens)."""
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None:
            ascending, order = logits.sort(dim=-1)
            drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - self.top_p
            drop[..., -1] = False
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return logits.log_softmax(dim=-1)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same distribution over its ``top_k`` candidates only, without sorting the vocabulary: log-probabilities
        `[..., top_k]` (``-inf`` where top-p drops a candidate) and their token ids `[..., top_k]`, most likely first.
        Needs ``top_k``."""
        if self.top_k is None:
            raise ValueError("DraftWarping.candidates needs a top_k (the candidates it keeps).")
        values, ids = (logits.float() / self.temperature).topk(min(self.top_k, logits.shape[-1]), dim=-1)
        if self.top_p is not None:
            probs = values.softmax(dim=-1)
            drop = probs.cumsum(dim=-1) - probs >= self.top_p  # the mass of the likelier candidates already reaches top_p
            drop[..., 0] = False
            values = values.masked_fill(drop, float("-inf"))
        return values.log_softmax(dim=-1), ids


def level_sizes(depth: int, top_k: int, total_tokens: int) -> list[int]:
    """Nodes per level (depth 1 first) of a sampled tree: ``top_k`` children of the root, the rest of the
    ``total_tokens - 1`` nodes spread evenly over the deeper levels (shallower ones first), a level never wider than
    ``top_k`` frontier nodes times ``top_k`` children."""
    nodes = total_tokens - 1
    sizes = [min(top_k, nodes)]
    rest = nodes - sizes[0]
    for level in range(depth - 1, 0, -1):
        size = min(-(-rest // level), min(top_k, sizes[-1]) * top_k)
        if size <= 0:
            break
        sizes.append(size)
        rest -= size
    return sizes


class SampledTreeProposer(PosSProposer):
    """A `PosSProposer` whose trees have children drawn without replacement from the draft's warped distribution.

    Args:
        draft, depth, top_k, total_tokens: as for `PosSProposer`.
        warping: the call's temperature / top-k / top-p (`DraftWarping`).
        generator: random generator of the draws (default: torch's global one).
    """

    def __init__(self, draft, depth: int, top_k: int, total_tokens: int, warping: DraftWarping,
                 generator: torch.Generator | None = None):  # fmt: skip
        super().__init__(draft, depth=depth, top_k=top_k, total_tokens=total_tokens)
        self.warping, self.generator = warping, generator

    @torch.no_grad()
    def propose(self, input_ids, target_hidden_states) -> DraftTree | BatchedTree:
        trees = super().propose(input_ids, target_hidden_states)
        if isinstance(trees, DraftTree):  # one row: drop draws past the support of q (never real children)
            valid = torch.isfinite(trees.scores)
            return trees if bool(valid.all()) else trees.select(valid)
        return trees

    def _target_probs(self, logprobs: torch.Tensor) -> torch.Tensor:
        """`[B, P, V]` probabilities over the target vocabulary of `[B, P, V']` draft log-probabilities."""
        probs = logprobs.exp()
        if self.draft.draft_to_target is None:
            return probs
        index = self.draft.to_target_tokens(torch.arange(probs.shape[-1], device=probs.device))
        full = probs.new_zeros(*probs.shape[:-1], self.draft.config.vocab_size)
        return full.scatter_(-1, index.expand_as(probs), probs)

    @torch.no_grad()
    def propose_batch(self, valid: torch.BoolTensor, positions: torch.LongTensor, depth: int | None = None):
        """Draft one sampled tree per row after the appended pairs (``valid``, ``positions``: `[B, L]`).

        Returns:
            a `BatchedTree`, levels in order and each node's children in draw order, with ``scores`` (cumulative
            draft log-probabilities; ``-inf`` and not ``valid`` for draws past the support), ``draft_probs``
            `[B, P, V]` (the distribution of each expanded node) and ``draft_probs_index`` `[B, n]`.
        """
        depth = self.depth if depth is None else min(depth, self.depth)
        sizes = level_sizes(max(depth, 0), self.top_k, self.total_tokens)[: max(depth, 0)]
        if not sizes:
            return BatchedTree.root_only(self.roots)
        draft, k = self.draft, self.top_k
        specialist = draft.config.specialist_for_step(0)
        keys, values = self._catch_up(specialist, positions)
        root_positions = positions[:, -1:]
        hidden = self.hidden[:, -1:]
        # RoPE of the root's position and of every level below it, in one call: (cos, sin) `[B, levels, head_dim]`
        levels = torch.arange(len(sizes), device=root_positions.device)
        rope = draft.position_embeddings(hidden, root_positions + levels)
        emb = tuple(part[:, :1] for part in rope)
        out = draft.layers[specialist](hidden, emb, keys, values, valid[:, None, None, :])  # [B, 1, H]
        batch, device = out.shape[0], out.device

        logq = self.warping(draft.compute_logits(out))  # [B, F, V'] distributions of the frontier nodes
        frontier_scores = torch.zeros(batch, 1, device=device)
        frontier_nodes = torch.zeros(batch, 1, dtype=torch.long, device=device)  # their node indices
        expanded_logq, expanded_nodes = [logq], [frontier_nodes]
        tokens = [self.roots[:, None].to(device)]
        parents = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
        scores, depths = [frontier_scores], [torch.zeros(batch, 1, dtype=torch.long, device=device)]
        state, frontier_start, count = _RoundState(), 0, 1
        context_mask = valid[:, None, :]
        for level, size in enumerate(sizes, start=1):
            width = logq.shape[1]
            slots = frontier_scores[..., None] + logq.topk(k, dim=-1).values  # [B, F, k] estimates before drawing
            chosen = torch.sort(slots.reshape(batch, -1), dim=1, descending=True, stable=True).indices[:, :size]
            picked = torch.zeros(batch, width * k, dtype=torch.bool, device=device).scatter_(1, chosen, True)
            slot = torch.sort(torch.where(picked, torch.arange(width * k, device=device), width * k),
                              dim=1).values[:, :size]  # [B, size] by (frontier node, draw order)
            draws, draw_logq = gumbel_top_k(logq, k, self.generator)  # [B, F, k]
            owner = slot // k
            level_tokens = draft.to_target_tokens(draws.reshape(batch, -1).gather(1, slot))
            level_scores = frontier_scores.gather(1, owner) + draw_logq.reshape(batch, -1).gather(1, slot)
            tokens.append(level_tokens)
            parents.append(frontier_nodes.gather(1, owner))
            scores.append(level_scores)
            depths.append(torch.full((batch, size), level, dtype=torch.long, device=device))
            level_nodes = count + torch.arange(size, device=device)[None].expand(batch, size)
            count += size
            if level == len(sizes):
                break
            # the next frontier: the best nodes of this level by drawn score (decides who gets children later)
            best = torch.sort(level_scores, dim=1, descending=True, stable=True).indices[:, : min(k, size)]
            parent_of_best = owner.gather(1, best)
            features = out.gather(1, parent_of_best[..., None].expand(-1, -1, out.shape[-1]))
            specialist = draft.config.specialist_for_step(level)
            layer = draft.layers[specialist]
            hidden = draft.fuse(level_tokens.gather(1, best), features)
            emb = tuple(part[:, level : level + 1].expand(batch, best.shape[1], -1) for part in rope)
            state.add(hidden, emb, None if level == 1 else frontier_start + parent_of_best)
            total = state.total
            self._catch_up(specialist, positions)
            keys, values = state.keys_values(specialist, layer, self.cache)  # context, then the tree rows
            fed = best.shape[1]
            mask = torch.cat([context_mask.expand(batch, fed, -1), state.ancestry[:, total - fed :]], dim=2)[:, None]
            out = layer(hidden, emb, keys, values, mask)
            logq = self.warping(draft.compute_logits(out))
            frontier_start = total - fed  # state rows of the new frontier
            frontier_scores = level_scores.gather(1, best)
            frontier_nodes = level_nodes.gather(1, best)
            expanded_logq.append(logq)
            expanded_nodes.append(frontier_nodes)

        scores = torch.cat(scores, dim=1)
        parents = torch.cat(parents, dim=1)
        nodes = torch.cat(expanded_nodes, dim=1)  # [B, P]
        probs_index = torch.full((batch, count), -1, dtype=torch.long, device=device)
        probs_index.scatter_(1, nodes, torch.arange(nodes.shape[1], device=device).expand(batch, -1))
        return BatchedTree(torch.cat(tokens, dim=1), parents, torch.cat(depths, dim=1), batched_ancestor_mask(parents),
                           torch.isfinite(scores), scores,
                           draft_probs=self._target_probs(torch.cat(expanded_logq, dim=1)),
                           draft_probs_index=probs_index)  # fmt: skip
