"""The automatic budget for sampled trees: ``tree_sampling="draft_probabilities"`` with ``tree_total_tokens="auto"``.

The recursive rejection rule keeps the target's distribution only if the number of children a node gets does not
depend on that node's own draws (`speculation.sampled_drafter`). So this budget cannot do what `TreeBudget.choose`
does for deterministic trees (draft deep, then keep the best nodes by score): it chooses the SHAPE of the next tree
before anything is drawn, from what the earlier rounds of the call observed. A shape is ``(d, n)``: ``n`` nodes spread
over ``d`` levels by `level_sizes(d, top_k, n)`, the same rule as a fixed sampled tree.

Expected tokens of a shape come from the acceptance observed per draft level and per child slot ([`SlotRates`]):
``a[l, i]``, the chance that the ``i``-th child drawn below a level-``l`` node is accepted once the ones drawn before
it were rejected (the recursive rule tries a node's children in draw order). A node with ``c`` children then lets
the walk go on with ``A_l(c) = 1 - prod_{i < c} (1 - a[l, i])``, and a level of ``s`` nodes below ``f`` expanded
nodes gives each about ``s / f`` children (interpolated between the whole numbers around it). The expected tokens,
corrected by the observed over the predicted tokens of the call, over the profiled time (drafting ``d`` levels plus
verifying ``n`` nodes) picks the shape. Plain fallback, pauses and probes are `TreeBudget`'s.
"""

from __future__ import annotations

import torch

from ..speculation.sampled_drafter import level_sizes
from ..speculation.tree import DraftTree
from .budget import TreeBudget


class SlotRates:
    """Acceptance by draft level and child slot over the rounds of one call.

    ``tried[l, i]`` counts the ``i``-th children (draw order) below level-``l`` nodes that the recursive rule tried,
    ``accepted[l, i]`` those it accepted. A level's rate starts from the rate of that slot pooled over all levels,
    which starts from ``first_prior`` (slot 0) or ``next_prior`` (later slots); each prior weighs ``prior_weight``
    observations.
    """

    def __init__(self, depth: int, top_k: int, first_prior: float = 0.35, next_prior: float = 0.15,
                 prior_weight: float = 2.0):  # fmt: skip
        self.tried = torch.zeros(depth, top_k, dtype=torch.float64)
        self.accepted = torch.zeros(depth, top_k, dtype=torch.float64)
        self.prior = torch.full((top_k,), next_prior, dtype=torch.float64)
        self.prior[0] = first_prior
        self.weight = prior_weight

    def rates(self) -> torch.Tensor:
        """`[depth, top_k]`: ``a[l, i]``."""
        w = self.weight
        pooled = (self.accepted.sum(0) + w * self.prior) / (self.tried.sum(0) + w)
        return (self.accepted + w * pooled) / (self.tried + w)

    def continue_rates(self) -> torch.Tensor:
        """`[depth, top_k + 1]`: ``A_l(c)`` for ``c = 0 .. top_k`` children."""
        missed = torch.cumprod(1.0 - self.rates(), dim=1)
        return torch.cat([torch.zeros(missed.shape[0], 1, dtype=missed.dtype), 1.0 - missed], dim=1)

    def observe(self, tree: DraftTree, path: torch.LongTensor) -> None:
        """One verified sampled tree (children of a node in draw order, `[n]` parents / depths) and its accepted
        path (node indices, root first). Loops over the path (at most depth + 1 nodes), never over the tree."""
        parents, depths = tree.parents.cpu(), tree.depths.cpu()
        n, depth, slots = parents.shape[0], self.tried.shape[0], self.tried.shape[1]
        same = parents[:, None] == parents[None, :]
        rank = (same & torch.ones(n, n, dtype=torch.bool).tril(-1)).sum(1)  # [n] place among its siblings
        children = torch.bincount(parents[1:].clamp(min=0), minlength=n) if n > 1 else torch.zeros(n, dtype=torch.long)
        path = path.cpu().tolist()
        for step, node in enumerate(path):
            level = int(depths[node])
            if level >= depth:
                break
            if step + 1 < len(path):
                slot = min(int(rank[path[step + 1]]), slots - 1)
                self.tried[level, : slot + 1] += 1
                self.accepted[level, slot] += 1
            else:
                self.tried[level, : min(int(children[node]), slots)] += 1


class SampledTreeBudget(TreeBudget):
    """`TreeBudget` for sampled trees: each round's shape ``(depth, nodes)`` is chosen before drawing
    (`choose_shape`); `observe_tree` feeds the verified tree back. Arguments as for `TreeBudget`, plus ``top_k``."""

    def __init__(self, profile, depth: int, max_nodes: int, top_k: int, **kwargs):
        super().__init__(profile, depth=depth, max_nodes=max_nodes, **kwargs)
        self.top_k = top_k
        self.slots = SlotRates(depth, top_k)
        self.shapes, shares, in_frontier = [], [], []
        for d in range(1, depth + 1):
            for n in range(d + 1, max_nodes + 1):
                sizes = level_sizes(d, top_k, n)[:d]
                if len(sizes) != d or sum(sizes) != n - 1:
                    continue
                self.shapes.append((d, n))
                frontier = [1] + [min(top_k, s) for s in sizes[:-1]]
                shares.append([s / f for s, f in zip(sizes, frontier)] + [0.0] * (depth - d))
                # the accepted node of a level has children only if it is among the top_k expanded ones
                in_frontier.append([1.0] + [min(1.0, top_k / s) for s in sizes[:-1]] + [0.0] * (depth - d))
        self._shares = torch.tensor(shares, dtype=torch.float64)  # [S, depth] children per expanded node
        self._in_frontier = torch.tensor(in_frontier, dtype=torch.float64)[:, :depth]  # [S, depth]
        self._seconds = torch.tensor([self._draft_seconds(d) + float(self._verify[n - 1]) for d, n in self.shapes],
                                     dtype=torch.float64)  # fmt: skip

    def expected_draft_tokens(self) -> torch.Tensor:
        """`[S]` expected accepted draft tokens of every shape under the observed slot rates (uncalibrated)."""
        table = self.slots.continue_rates()  # [depth, k + 1]
        shares = self._shares.clamp(max=self.top_k)
        whole = shares.floor().long()
        frac = shares - whole
        levels = torch.arange(shares.shape[1])[None].expand_as(whole)
        low = table[levels, whole]
        high = table[levels, (whole + 1).clamp(max=self.top_k)]
        go_on = ((1.0 - frac) * low + frac * high) * self._in_frontier  # [S, depth]
        return torch.cumprod(go_on, dim=1).sum(1)

    def choose_shape(self) -> tuple[int, int]:
        """``(depth, nodes)`` of the next sampled tree: the highest expected tokens per profiled second."""
        raw = self.expected_draft_tokens()
        rate = (1.0 + raw * self.calibration) / self._seconds
        best = int(torch.argmax(rate))
        depth, nodes = self.shapes[best]
        self.chosen_depth = self.next_depth = depth
        self._last = float(raw[best]), float(self._seconds[best])
        return depth, nodes

    def observe_tree(self, tree: DraftTree, path: torch.LongTensor) -> None:
        self.slots.observe(tree, path)
