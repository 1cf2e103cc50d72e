"""Acceptance of a verified draft tree: which path the target keeps, and the token it adds itself.

The target has scored every node of a tree in one forward pass (``logits[i]`` is its next-token prediction after the
root-to-node-``i`` path). These functions pick the accepted path:

- greedy: the longest root-to-node path along which the target's argmax agrees with the node tokens, plus the
  target's argmax at the last accepted node (the bonus token);
- sampling: at the current node take the target distribution ``p`` after the logits processors, try the node's
  distinct children in order, accepting child ``x`` with probability ``p(x)`` (renormalised over what is left after
  earlier rejections); when every child is rejected, sample the bonus token from the residual distribution. As the
  children are deterministic draft picks, this reproduces the target distribution exactly;
- sampling a sampled tree (``tree_sampling="draft_probabilities"``, the tree carries ``draft_probs``): the recursive
  rule with the target's ``p`` and the draft's ``q`` (`rejection.recursive_rejection_sample`), all rows' current
  nodes at once (`sampled_accept`).

All functions are pure: they read logits and trees and return new tensors. Loops run over tree depth at most, never
over all nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rejection import recursive_rejection_sample, sample_rows
from .tree import BatchedTree, DraftTree


@dataclass
class TreeAcceptance:
    """The outcome of verifying one tree.

    Attributes:
        path (`torch.LongTensor` of shape `[a + 1]`): accepted node indices, root first, in depth order.
        tokens (`torch.LongTensor` of shape `[a + 1]`): the ``a`` accepted draft tokens followed by the bonus token.
        scores (`torch.FloatTensor` of shape `[a + 1, vocab]`): the processed target scores each emitted token was
            chosen from.
        proposed_next (`bool`): whether the last accepted node had children, i.e. whether a draft token at depth
            ``a + 1`` was proposed (and rejected).
    """

    path: torch.LongTensor
    tokens: torch.LongTensor
    scores: torch.FloatTensor
    proposed_next: bool

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens ``a`` (the bonus token is not counted)."""
        return int(self.path.shape[0]) - 1


def greedy_accept(tree: DraftTree, logits: torch.FloatTensor) -> TreeAcceptance:
    """Greedy acceptance without logits processors: `batched_greedy_accept` of a batch of one.

    Args:
        tree: the verified tree (``n`` nodes).
        logits (`torch.FloatTensor` of shape `[n, vocab]`): target logits at every node.
    """
    accepted = batched_greedy_accept(tree.as_batch(), logits[None])
    path = accepted.index[0]
    return TreeAcceptance(path=path, tokens=accepted.tokens[0], scores=logits[path],
                          proposed_next=bool(accepted.proposed_next[0]))  # fmt: skip


def rejection_sample_children(
    probs: torch.FloatTensor, child_tokens: torch.LongTensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Sequential rejection over a node's children, vectorised over the children.

    Child ``x_i`` (tried in order) is accepted with probability ``p(x_i) / (1 - sum_{j<i} p(x_j))``, the target
    probability renormalised after zeroing the children already rejected. Repeated child tokens are tried once.

    Args:
        probs (`torch.FloatTensor` of shape `[vocab]`): target distribution at the node (after processors).
        child_tokens (`torch.LongTensor` of shape `[k]`): the node's children tokens, in trial order.

    Returns:
        `(child, token)`: the index into ``child_tokens`` of the accepted child and its token, or ``(-1, token)`` with
        a token sampled from the residual distribution when every child is rejected.
    """
    k = child_tokens.shape[0]
    if k > 0:
        earlier = torch.ones(k, k, dtype=torch.bool, device=probs.device).tril(-1)
        repeated = (earlier & (child_tokens[:, None] == child_tokens[None, :])).any(dim=-1)
        p = torch.where(repeated, torch.zeros_like(child_tokens, dtype=probs.dtype), probs[child_tokens])
        remaining = 1.0 - (torch.cumsum(p, dim=0) - p)  # mass left when child i is tried
        ratio = p / remaining.clamp(min=1e-12)
        u = torch.rand(k, generator=generator, device=probs.device, dtype=probs.dtype)
        accepted = (u < ratio).nonzero()
        if accepted.numel() > 0:
            i = int(accepted[0, 0].item())
            return i, int(child_tokens[i].item())
    residual = probs.clone()
    residual[child_tokens] = 0.0
    if not bool((residual.sum() > 0).item()):
        residual = probs
    token = int(sample_rows(residual[None], generator)[0])
    return -1, token


def sequential_accept(
    tree: DraftTree,
    logits: torch.FloatTensor,
    prefix_ids: torch.LongTensor,
    logits_processor,
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> TreeAcceptance:
    """Acceptance that applies ``logits_processor`` at each node for that node's own prefix (loop over depth).

    Used for sampling and for greedy decoding with processors (repetition penalty, min length, ...): at depth ``d``
    the processors see ``prefix_ids`` followed by the ``d`` tokens accepted so far, exactly as ``generate`` would.

    Args:
        tree: the verified tree (``n`` nodes).
        logits (`torch.FloatTensor` of shape `[n, vocab]`): raw target logits at every node.
        prefix_ids (`torch.LongTensor` of shape `[1, L]`): the sequence up to and including the root token.
        logits_processor: a `LogitsProcessorList` (possibly empty).
        do_sample: sample by rejection over children (True) or compare with the argmax (False).
    """
    parents = tree.parents
    node, ids = 0, prefix_ids
    path, tokens, scores = [0], [], []
    while True:
        node_scores = logits_processor(ids, logits[node : node + 1].float())  # [1, vocab]
        scores.append(node_scores)
        children = (parents == node).nonzero().squeeze(-1)
        child_tokens = tree.tokens[children]
        if do_sample:
            probs = torch.softmax(node_scores[0], dim=-1)
            choice, token = rejection_sample_children(probs, child_tokens, generator)
        else:
            token = int(node_scores[0].argmax().item())
            hits = (child_tokens == token).nonzero()
            choice = int(hits[0, 0].item()) if hits.numel() > 0 else -1
        tokens.append(token)
        if choice < 0:
            break
        node = int(children[choice].item())
        path.append(node)
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=-1)
    return TreeAcceptance(
        path=torch.tensor(path, dtype=torch.long, device=logits.device),
        tokens=torch.tensor(tokens, dtype=torch.long, device=logits.device),
        scores=torch.cat(scores, dim=0),
        proposed_next=children.numel() > 0,
    )


def accept_tree(
    tree: DraftTree,
    logits: torch.FloatTensor,
    prefix_ids: torch.LongTensor,
    logits_processor=None,
    do_sample: bool = False,
    generator: torch.Generator | None = None,
) -> TreeAcceptance:
    """Pick the accepted path of a verified tree: vectorised greedy when no processor applies, else per depth."""
    if do_sample and tree.draft_probs is not None:
        processors = [identity_processor if logits_processor is None else logits_processor]
        accepted, scores = sampled_accept(tree.as_batch(), logits[None], [prefix_ids], processors, generator)
        count = int(accepted.counts[0])
        return TreeAcceptance(path=accepted.index[0, -count:], tokens=accepted.tokens[0, -count:], scores=scores[0],
                              proposed_next=bool(accepted.proposed_next[0]))  # fmt: skip
    if not do_sample and (logits_processor is None or len(logits_processor) == 0):
        return greedy_accept(tree, logits.float())
    if logits_processor is None:
        logits_processor = identity_processor
    return sequential_accept(tree, logits, prefix_ids, logits_processor, do_sample, generator)


def identity_processor(input_ids, scores):
    return scores


@dataclass
class BatchAcceptance:
    """Accepted paths of B rows, right-aligned to a common width ``m = max_b(counts[b])``.

    Attributes:
        index (`torch.LongTensor` of shape `[B, m]`): row ``b``'s root and accepted nodes in its last ``counts[b]``
            columns, in depth order (earlier columns repeat the root, 0).
        tokens (`torch.LongTensor` of shape `[B, m]`): the tokens emitted by row ``b`` (accepted draft tokens then the
            bonus token) in its last ``counts[b]`` columns. ``tokens[b, j]`` follows node ``index[b, j]``.
        counts (`torch.LongTensor` of shape `[B]`): tokens emitted per row (accepted draft tokens + 1).
        proposed_next (`torch.BoolTensor` of shape `[B]`): the last accepted node had a valid child.
    """

    index: torch.LongTensor
    tokens: torch.LongTensor
    counts: torch.LongTensor
    proposed_next: torch.BoolTensor

    @property
    def width(self) -> int:
        return int(self.index.shape[1])

    @property
    def valid(self) -> torch.BoolTensor:
        """`[B, m]` columns that hold a row's node / token."""
        return torch.arange(self.width, device=self.counts.device)[None] >= (self.width - self.counts)[:, None]


def _has_valid_child(tree: BatchedTree, nodes: torch.LongTensor) -> torch.BoolTensor:
    """`[B]`: node ``nodes[b]`` of row ``b`` has a valid child."""
    return ((tree.parents == nodes[:, None]) & tree.valid).any(dim=1)


def batched_greedy_accept(tree: BatchedTree, logits: torch.Tensor) -> BatchAcceptance:
    """Greedy acceptance without processors, vectorised over rows and nodes (`logits`: `[B, n, vocab]`)."""
    argmax = logits.argmax(dim=-1)  # [B, n]
    parent_choice = argmax.gather(1, tree.parents.clamp(min=0))
    match = (tree.tokens == parent_choice) & tree.valid
    match[:, 0] = True
    reachable = ~(tree.tree_mask & ~match[:, None, :]).any(dim=-1)  # [B, n]
    depth_if_reachable = torch.where(reachable, tree.depths, torch.full_like(tree.depths, -1))
    best = depth_if_reachable.argmax(dim=1)  # [B] deepest reachable node (first of equal depth)
    rows = torch.arange(tree.tokens.shape[0], device=logits.device)
    on_path = tree.tree_mask[rows, best]  # [B, n]
    counts = on_path.sum(dim=1)
    width = int(counts.max().item())
    nodes = torch.arange(tree.num_nodes, device=logits.device)[None]
    index = torch.sort(torch.where(on_path, nodes, -1), dim=1).values[:, -width:].clamp(min=0)  # right-aligned
    bonus = argmax[rows, best]
    tokens = torch.cat([tree.tokens.gather(1, index)[:, 1:], bonus[:, None]], dim=1)
    return BatchAcceptance(index, tokens, counts, _has_valid_child(tree, best))


def per_row_accept(
    tree: BatchedTree, logits: torch.Tensor, prefixes: list[torch.LongTensor], processors: list, do_sample: bool
) -> BatchAcceptance:
    """Row-by-row `sequential_accept` (sampling, or greedy with processors).

    Args:
        tree: the verified trees; logits (`[B, n, vocab]`): raw target logits at every node.
        prefixes: per row, `[1, L_b]` the row's sequence up to and including its root (left padding included, as
            ``generate`` shows it to processors in a batch).
        processors: per row, its logits processors (`row_processors`).
    """
    paths, emitted, proposed = [], [], []
    for b, prefix in enumerate(prefixes):
        row_tree, kept = tree.row(b)
        accepted = sequential_accept(row_tree, logits[b, kept], prefix, processors[b], do_sample)
        paths.append(kept[accepted.path.to(kept.device)])
        emitted.append(accepted.tokens)
        proposed.append(accepted.proposed_next)
    counts = torch.tensor([p.shape[0] for p in paths], device=logits.device)
    width = int(counts.max().item())
    index = torch.zeros(len(paths), width, dtype=torch.long, device=logits.device)
    tokens = torch.zeros_like(index)
    for b, (path, row_tokens) in enumerate(zip(paths, emitted)):
        index[b, width - path.shape[0] :] = path
        tokens[b, width - path.shape[0] :] = row_tokens.to(tokens.device)
    return BatchAcceptance(index, tokens, counts, torch.tensor(proposed, device=logits.device))


def accept_batch(tree: BatchedTree, logits, prefixes, processors, do_sample=False) -> BatchAcceptance:
    """Vectorised greedy when no processor applies (``processors`` None), else row by row.

    ``prefixes``: a callable giving the rows' sequences (only built when needed); ``processors``: one per row.
    """
    if not do_sample and processors is None:
        return batched_greedy_accept(tree, logits.float())
    if do_sample and tree.draft_probs is not None:
        return sampled_accept(tree, logits, prefixes(), processors)[0]
    return per_row_accept(tree, logits, prefixes(), processors, do_sample)


def _children_in_order(tree: BatchedTree) -> torch.LongTensor:
    """`[B, n, c]`: each node's valid children in node order (= draw order in a sampled tree), ``n`` past the end."""
    n = tree.num_nodes
    nodes = torch.arange(n, device=tree.tokens.device)
    is_child = (tree.parents[:, None, :] == nodes[None, :, None]) & tree.valid[:, None, :]  # [B, parent, child]
    width = max(int(is_child.sum(-1).max()), 1)
    return torch.where(is_child, nodes, n).sort(dim=-1).values[..., :width]


def sampled_accept(tree: BatchedTree, logits: torch.Tensor, prefixes: list[torch.LongTensor], processors: list,
                   generator: torch.Generator | None = None) -> tuple[BatchAcceptance, list[torch.FloatTensor]]:
    """Acceptance of sampled trees by recursive rejection sampling with ``p`` and ``q``, a walk over depth.

    At each depth the rows still walking form one flat batch: their current node's target distribution ``p`` (after
    that row's processors for its own prefix), the draft distribution ``q`` its children were drawn from
    (``tree.draft_probs``) and its children in draw order go through `recursive_rejection_sample` together.

    Args:
        tree: sampled trees with ``draft_probs`` / ``draft_probs_index``; logits (`[B, n, vocab]`): raw target logits.
        prefixes: per row, `[1, L_b]` its sequence up to and including its root; processors: per row.

    Returns:
        the `BatchAcceptance` and, per row, the processed scores `[a_b + 1, vocab]` of its emitted tokens.
    """
    batch, n = tree.tokens.shape
    children = _children_in_order(tree)  # [B, n, c]
    rows = torch.arange(batch, device=logits.device)
    node = torch.zeros(batch, dtype=torch.long, device=logits.device)
    walking = [True] * batch
    paths, emitted, scores = [[0] for _ in range(batch)], [[] for _ in range(batch)], [[] for _ in range(batch)]
    proposed = [False] * batch
    ids = list(prefixes)
    while any(walking):
        live = [b for b in range(batch) if walking[b]]
        at = torch.tensor(live, device=logits.device)
        here = node[at]
        processed = torch.cat([processors[b](ids[b], logits[b, int(node[b])][None].float()) for b in live])
        kids = children[at, here]  # [N, c]
        has_q = tree.draft_probs_index[at, here]
        kid_valid = (kids < n) & (has_q >= 0)[:, None]
        kid_tokens = tree.tokens[at[:, None], kids.clamp(max=n - 1)]
        q = tree.draft_probs[at, has_q.clamp(min=0)]
        choice, token = recursive_rejection_sample(torch.softmax(processed, dim=-1), q, kid_tokens, kid_valid,
                                                   generator)  # fmt: skip
        for j, b in enumerate(live):
            emitted[b].append(int(token[j]))
            scores[b].append(processed[j : j + 1])
            if int(choice[j]) < 0:
                walking[b], proposed[b] = False, bool(kid_valid[j].any())
                continue
            node[b] = kids[j, int(choice[j])]
            paths[b].append(int(node[b]))
            ids[b] = torch.cat([ids[b], ids[b].new_tensor([[int(token[j])]])], dim=-1)
    counts = torch.tensor([len(p) for p in paths], device=logits.device)
    width = int(counts.max())
    index = torch.zeros(batch, width, dtype=torch.long, device=logits.device)
    tokens = torch.zeros_like(index)
    for b in rows.tolist():
        index[b, width - len(paths[b]) :] = torch.tensor(paths[b], device=logits.device)
        tokens[b, width - len(paths[b]) :] = torch.tensor(emitted[b], device=logits.device)
    accepted = BatchAcceptance(index, tokens, counts, torch.tensor(proposed, device=logits.device))
    return accepted, [torch.cat(s, dim=0) for s in scores]
