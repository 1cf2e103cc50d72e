"""Draft trees: the data structure a draft proposes and the target verifies.

A tree has ``n`` nodes, root first. The root is the last token the target produced (not yet in the target's
cache); every other node is a draft token. All functions here are pure tensor functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A draft tree over ``n`` nodes, root first.

    Attributes:
        tokens (`torch.LongTensor` of shape `[n]`): node tokens; ``tokens[0]`` is the root.
        parents (`torch.LongTensor` of shape `[n]`): parent node index; ``parents[0] == -1``. Parents come before
            their children (``parents[i] < i``).
        depths (`torch.LongTensor` of shape `[n]`): depth of each node; the root has depth 0.
        tree_mask (`torch.BoolTensor` of shape `[n, n]`): ``tree_mask[i, j]`` is True when node ``j`` is node ``i``
            itself or one of its ancestors.
        scores (`torch.FloatTensor` of shape `[n]`, *optional*): cumulative draft log-probability of each node (0 for
            the root). In a tree with several sources: the log of the estimated probability that the node is accepted.
        sources (`torch.LongTensor` of shape `[n]`, *optional*): bit mask of the sources that proposed each node
            (`trie.DRAFT_SOURCE`, `trie.CONTEXT_SOURCE`; 0 for the root), with the copy flags and the position in a
            copied continuation in its higher bits (`trie.CHAIN_START`, `trie.chain_position`); None for a tree of
            the draft alone.
        draft_logprobs (`torch.FloatTensor` of shape `[n]`, *optional*): with ``sources``, the draft's log-probability
            of each node given its parent (0 where the draft did not propose the node).
        draft_probs (`torch.FloatTensor` of shape `[P, vocab]`, *optional*): in a sampled tree
            (``tree_sampling="draft_probabilities"``), the draft distribution each expanded node's children were drawn
            from, without replacement, in node order.
        draft_probs_index (`torch.LongTensor` of shape `[n]`, *optional*): row of ``draft_probs`` of each node (-1 for
            a node that was not expanded).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    tree_mask: torch.BoolTensor
    scores: torch.FloatTensor | None = None
    sources: torch.LongTensor | None = None
    draft_logprobs: torch.FloatTensor | None = None
    draft_probs: torch.FloatTensor | None = None
    draft_probs_index: torch.LongTensor | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max().item())

    @property
    def is_chain(self) -> bool:
        """Whether the nodes form one path in order (node ``i``'s parent is node ``i - 1``): a plain causal
        continuation, verifiable without a tree mask. One tensor comparison, no loop over nodes."""
        return is_chain(self.parents)


    def paths(self) -> set[tuple[int, ...]]:
        """The set of root-to-node token paths (root token excluded), for comparing trees regardless of node order."""
        tokens = self.tokens.tolist()
        mask = self.tree_mask.tolist()
        depths = self.depths.tolist()
        out = set()
        for i in range(1, len(tokens)):
            ancestors = sorted((j for j in range(len(tokens)) if mask[i][j] and j != 0), key=lambda j: depths[j])
            out.add(tuple(tokens[j] for j in ancestors))
        return out

    @classmethod
    def root_only(cls, token: torch.Tensor) -> "DraftTree":
        """A tree of just the root: verifying it is a plain decoding step."""
        token = torch.as_tensor(token).reshape(1)
        device = token.device
        return cls(
            tokens=token.long(),
            parents=torch.tensor([-1], device=device),
            depths=torch.zeros(1, dtype=torch.long, device=device),
            tree_mask=torch.ones(1, 1, dtype=torch.bool, device=device),
            scores=torch.zeros(1, device=device),
        )

    def _per_node(self, name: str, fn):
        value = getattr(self, name)
        return None if value is None else fn(value)

    def select(self, keep: torch.Tensor) -> "DraftTree":
        """The sub-tree of the nodes in ``keep`` (bool mask `[n]` or ascending indices including 0, closed under
        parents). Node order is preserved, so parents still come before children."""
        if keep.dtype == torch.bool:
            keep = torch.nonzero(keep).flatten()
        new_index = torch.full((self.num_nodes,), -1, dtype=torch.long, device=self.tokens.device)
        new_index[keep] = torch.arange(keep.shape[0], device=self.tokens.device)
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        if bool((parents[1:] < 0).any()):
            raise ValueError("the selected nodes are not closed under parents")
        return DraftTree(
            tokens=self.tokens[keep],
            parents=parents,
            depths=self.depths[keep],
            tree_mask=self.tree_mask[keep][:, keep],
            scores=None if self.scores is None else self.scores[keep],
            sources=self._per_node("sources", lambda v: v[keep]),
            draft_logprobs=self._per_node("draft_logprobs", lambda v: v[keep]),
            draft_probs=self.draft_probs,
            draft_probs_index=self._per_node("draft_probs_index", lambda v: v[keep]),
        )

    def as_batch(self) -> "BatchedTree":
        """This tree as a batch of one (every node valid)."""
        valid = torch.ones(1, self.num_nodes, dtype=torch.bool, device=self.tokens.device)
        scores = None if self.scores is None else self.scores[None]
        return BatchedTree(self.tokens[None], self.parents[None], self.depths[None], self.tree_mask[None], valid, scores,
                           self._per_node("sources", lambda v: v[None]),
                           self._per_node("draft_logprobs", lambda v: v[None]),
                           self._per_node("draft_probs", lambda v: v[None]),
                           self._per_node("draft_probs_index", lambda v: v[None]))

    def to(self, device) -> "DraftTree":
        return DraftTree(
            tokens=self.tokens.to(device),
            parents=self.parents.to(device),
            depths=self.depths.to(device),
            tree_mask=self.tree_mask.to(device),
            scores=None if self.scores is None else self.scores.to(device),
            sources=self._per_node("sources", lambda v: v.to(device)),
            draft_logprobs=self._per_node("draft_logprobs", lambda v: v.to(device)),
            draft_probs=self._per_node("draft_probs", lambda v: v.to(device)),
            draft_probs_index=self._per_node("draft_probs_index", lambda v: v.to(device)),
        )


def is_chain(parents: torch.LongTensor) -> bool:
    """Whether ``parents`` (`[n]`, or `[B, n]` for a batch of trees) describe chains: ``parents[..., i] == i - 1``."""
    n = parents.shape[-1]
    if n <= 1:
        return True
    return bool((parents[..., 1:] == torch.arange(n - 1, device=parents.device)).all())


def ancestor_mask_from_parents(parents: torch.LongTensor) -> torch.BoolTensor:
    """The `[n, n]` ancestor-or-self mask of one tree (``parents[i] < i``, root ``-1``): `batched_ancestor_mask` of a
    batch of one."""
    return batched_ancestor_mask(parents[None])[0]



def batched_ancestor_mask(parents: torch.LongTensor) -> torch.BoolTensor:
    """Ancestor-or-self masks of a batch of trees: `[B, n]` parents (``-1`` for roots) -> `[B, n, n]` bool.

    Vectorised by repeated squaring of the parent relation: ``O(log depth)`` batched matrix products, no loop over
    nodes.
    """
    batch, n = parents.shape
    device = parents.device
    reach = torch.eye(n, dtype=torch.bool, device=device).expand(batch, n, n).clone()
    rows, cols = (parents >= 0).nonzero(as_tuple=True)
    reach[rows, cols, parents[rows, cols]] = True
    length = 1
    while length < n:
        nxt = torch.bmm(reach.float(), reach.float()) > 0
        if torch.equal(nxt, reach):
            break
        reach = nxt
        length *= 2
    return reach


@dataclass
class BatchedTree:
    """One draft tree per row, padded to a common node count ``n``; padded nodes have ``valid`` False.

    Attributes:
        tokens, parents, depths (`torch.LongTensor` of shape `[B, n]`): as in `DraftTree`, per row (root first,
            ``parents[b, i] < i``).
        tree_mask (`torch.BoolTensor` of shape `[B, n, n]`): ancestor-or-self relation of each row's tree.
        valid (`torch.BoolTensor` of shape `[B, n]`): nodes that may be accepted (closed under parents).
        scores (`torch.FloatTensor` of shape `[B, n]`, *optional*): cumulative draft log-probabilities (root 0).
        sources, draft_logprobs (`[B, n]`, *optional*): as in `DraftTree`, per row.
        draft_probs (`[B, P, vocab]`), draft_probs_index (`[B, n]`) (*optional*): as in `DraftTree`, per row.
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    tree_mask: torch.BoolTensor
    valid: torch.BoolTensor
    scores: torch.FloatTensor | None = None
    sources: torch.LongTensor | None = None
    draft_logprobs: torch.FloatTensor | None = None
    draft_probs: torch.FloatTensor | None = None
    draft_probs_index: torch.LongTensor | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def is_chain(self) -> bool:
        """Whether every row's tree is a chain in node order (invalid nodes included: they are still computed)."""
        return is_chain(self.parents)

    def row(self, b: int) -> tuple[DraftTree, torch.LongTensor]:
        """Row ``b`` as a `DraftTree` of its valid nodes, with their indices `[n_b]` in the padded row."""
        keep = self.valid[b].nonzero().flatten()
        full = DraftTree(self.tokens[b], self.parents[b], self.depths[b], self.tree_mask[b])
        return full.select(keep), keep

    def limit_depth(self, max_depths: torch.LongTensor) -> "BatchedTree":
        """Invalidate the nodes of row ``b`` deeper than ``max_depths[b]`` (`[B]`)."""
        valid = self.valid & (self.depths <= max_depths[:, None])
        return BatchedTree(self.tokens, self.parents, self.depths, self.tree_mask, valid, self.scores, self.sources,
                           self.draft_logprobs, self.draft_probs, self.draft_probs_index)

    def single(self) -> DraftTree:
        """The tree of a batch of one whose nodes are all valid, as a `DraftTree`."""
        scores = None if self.scores is None else self.scores[0]
        return DraftTree(self.tokens[0], self.parents[0], self.depths[0], self.tree_mask[0], scores,
                         None if self.sources is None else self.sources[0],
                         None if self.draft_logprobs is None else self.draft_logprobs[0],
                         None if self.draft_probs is None else self.draft_probs[0],
                         None if self.draft_probs_index is None else self.draft_probs_index[0])

    @classmethod
    def root_only(cls, roots: torch.LongTensor) -> "BatchedTree":
        """Trees of just the roots `[B]`: verifying them is a plain decoding step."""
        batch, device = roots.shape[0], roots.device
        zeros = torch.zeros(batch, 1, dtype=torch.long, device=device)
        ones = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
        return cls(roots[:, None].long(), zeros - 1, zeros, ones, ones[:, 0])

    @classmethod
    def pack(cls, trees: list[DraftTree]) -> "BatchedTree":
        """Pad per-row `DraftTree`s to one node count (padded nodes: children of the root, never valid)."""
        n = max(tree.num_nodes for tree in trees)
        device = trees[0].tokens.device
        tokens = torch.zeros(len(trees), n, dtype=torch.long, device=device)
        parents = torch.zeros_like(tokens)
        depths = torch.ones_like(tokens)
        valid = torch.zeros(len(trees), n, dtype=torch.bool, device=device)
        for b, tree in enumerate(trees):
            size = tree.num_nodes
            tokens[b, :size], parents[b, :size], depths[b, :size] = tree.tokens, tree.parents, tree.depths
            valid[b, :size] = True
        parents[:, 0] = -1
        depths[:, 0] = 0
        return cls(tokens, parents, depths, batched_ancestor_mask(parents), valid)
