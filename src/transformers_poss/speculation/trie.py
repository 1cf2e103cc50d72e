"""One tree from several sources: token chains grafted below tree nodes, identical prefixes merged (a trie).

A node of a draft tree stands for a token path; a continuation found elsewhere (e.g. copied from the context,
`context_match`) is a chain of tokens below some node. Grafting inserts each chain into the tree as into a trie: a
chain token that equals a child already there (drafted, or added by an earlier chain) reuses that node, so every path
appears once and siblings never repeat a token. Each node records which sources proposed it (a bit mask).

Pure tensor code for B rows, vectorised over rows, chains and chain positions: no loop over nodes. Nothing here
knows about acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import BatchedTree, batched_ancestor_mask

DRAFT_SOURCE = 1  # bit of ``sources``: the draft network proposed the node
CONTEXT_SOURCE = 2  # bit of ``sources``: a continuation copied from the context passes through the node
CHAIN_START = 4  # bit of ``sources`` (with CONTEXT_SOURCE): the node is the first token of such a continuation
SHORT_MATCH = 8  # bit of ``sources`` (with CHAIN_START): that continuation was found by a match of a single token
POSITION_SHIFT = 4  # ``sources >> POSITION_SHIFT``: the node's 1-based position in a continuation (0: none)
SOURCE_NAMES = {DRAFT_SOURCE: "draft", CONTEXT_SOURCE: "context"}  # the sources reported in statistics


def chain_position(sources: torch.LongTensor) -> torch.LongTensor:
    """The 1-based position of each node in the continuation copied through it (the largest, where several pass
    through it; 0 where none does), stored in the high bits of ``sources``."""
    return sources >> POSITION_SHIFT


@dataclass
class MergedTree:
    """A tree grafted from several sources, before any node is dropped.

    Attributes:
        tree (`BatchedTree`): ``n'`` nodes per row, root first, parents before children; padded nodes are invalid.
        sources (`torch.LongTensor` of shape `[B, n']`): bit mask of the sources proposing each node (0: the root and
            padding).
        chain_step (`torch.LongTensor` of shape `[B, n']`): the largest 1-based chain position at which a chain
            passes through the node (1: only chains that start there), 0 where no chain does.
        base_index (`torch.LongTensor` of shape `[B, n']`): index of the node in the base tree, -1 for grafted nodes.

    The tree's ``tree_mask`` is not built here (None): a merged tree is usually cut down first (`keep_nodes` builds
    the mask of what is kept).
    """

    tree: BatchedTree
    sources: torch.LongTensor
    chain_step: torch.LongTensor
    base_index: torch.LongTensor


def unique_rows(rows: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`[K, W]` non-negative-but-for--1 integers -> (the distinct rows in lexicographic order `[U, W]`, the index of
    each input row among them `[K]`): ``torch.unique(rows, dim=0, return_inverse=True)`` without its row-by-row loop.

    Values are packed several to an int64 (big-endian, so the order of packed columns is the order of the rows), then
    sorted column by column with stable sorts, last column first.
    """
    count, width = rows.shape
    shifted = rows + 1  # -1 (padding) -> 0
    bits = max(1, int(shifted.max()).bit_length()) if rows.numel() else 1
    per_word = max(1, 63 // bits)
    words = []
    for start in range(0, width, per_word):  # a handful of words: width / (63 // bits)
        word = torch.zeros(count, dtype=torch.long, device=rows.device)
        for column in range(start, min(start + per_word, width)):
            word = (word << bits) | shifted[:, column]
        words.append(word)
    order = torch.arange(count, device=rows.device)
    for word in reversed(words):
        order = order[torch.argsort(word[order], stable=True)]
    ordered = torch.stack(words, dim=1)[order]
    new_group = torch.ones(count, dtype=torch.bool, device=rows.device)
    new_group[1:] = (ordered[1:] != ordered[:-1]).any(dim=1)
    group = torch.cumsum(new_group.long(), 0) - 1
    inverse = torch.empty_like(group).scatter_(0, order, group)
    return rows[order[new_group]], inverse


def graft_chains(base: BatchedTree, anchors: torch.LongTensor, chain_tokens: torch.LongTensor,
                 chain_valid: torch.BoolTensor, base_source: int = DRAFT_SOURCE,
                 chain_source: int = CONTEXT_SOURCE) -> MergedTree:  # fmt: skip
    """Insert chains into ``base`` as into a trie.

    Args:
        base: the base trees, `[B, n]` (e.g. the draft's; its valid nodes keep their indices).
        anchors (`torch.LongTensor` of shape `[B, C]`): the node below which chain ``c`` of row ``b`` starts.
        chain_tokens (`torch.LongTensor` of shape `[B, C, m]`): the chains.
        chain_valid (`torch.BoolTensor` of shape `[B, C, m]`): real chain tokens (a prefix of each chain).
        base_source, chain_source: source bits of the base nodes and of the chains' nodes.

    Returns:
        a `MergedTree`: the base nodes first (same indices), then the new nodes, shallower ones first. A chain token
        equal to an existing child of its parent (base or grafted) reuses that node and marks it with
        ``chain_source``; identical chain prefixes become one node.

    A node IS its root-to-node token path: every valid base node and every chain prefix is written as its path
    (padded), and one ``unique`` over the paths of all rows merges equal ones. No loop over nodes or chain positions.
    """
    batch, n = base.tokens.shape
    chains, m = chain_tokens.shape[1], chain_tokens.shape[2]
    device = base.tokens.device
    base_valid = base.valid.clone()
    base_valid[:, 0] = True
    mask = base.tree_mask if base.tree_mask is not None else batched_ancestor_mask(base.parents)
    width = int(base.depths.max()) + 1 + m  # root, the deepest base node, a whole chain
    pad = -1

    # paths of the base nodes: [B, n, W], token of the depth-d ancestor at column d
    base_paths = torch.full((batch, n, width), pad, dtype=torch.long, device=device)
    rows, nodes, ancestors = mask.nonzero(as_tuple=True)
    base_paths[rows, nodes, base.depths[rows, ancestors]] = base.tokens[rows, ancestors]

    # paths of the chain prefixes: [B, C, m, W], prefix j = the anchor's path + chain tokens 0..j
    alive = chain_valid.long().cumprod(-1).bool() & base_valid.gather(1, anchors)[..., None]  # [B, C, m]
    if not bool(alive.any()):  # nothing to graft: the base trees as they are
        zeros = torch.zeros_like(base.tokens)
        tree = BatchedTree(base.tokens, base.parents, base.depths, None, base.valid)
        sources = torch.where(base.valid, base_source, 0)
        sources[:, 0] = 0
        return MergedTree(tree=tree, sources=sources, chain_step=zeros,
                          base_index=torch.arange(n, device=device)[None].expand(batch, n).clone())
    anchor_depths = base.depths.gather(1, anchors)  # [B, C]
    columns = torch.arange(width, device=device)
    offset = columns[None, None, :] - anchor_depths[..., None] - 1  # [B, C, W] chain position held by a column
    by_column = chain_tokens.gather(2, offset.clamp(min=0, max=m - 1))  # [B, C, W]
    anchor_paths = base_paths.gather(1, anchors[..., None].expand(batch, chains, width))  # [B, C, W]
    position = torch.arange(m, device=device)[None, None, :, None]  # [1, 1, m, 1]
    chain_paths = torch.where(offset[:, :, None] < 0, anchor_paths[:, :, None],
                              torch.where(offset[:, :, None] <= position, by_column[:, :, None], pad))

    # one unique over (row, path) of every valid base node and live chain prefix
    row_ids = torch.arange(batch, device=device)
    base_keys = torch.cat([row_ids[:, None, None].expand(batch, n, 1), base_paths], dim=2)[base_valid]
    chain_keys = torch.cat([row_ids[:, None, None, None].expand(batch, chains, m, 1), chain_paths], dim=3)[alive]
    paths, inverse = unique_rows(torch.cat([base_keys, chain_keys]))
    base_count = base_keys.shape[0]
    base_of, chain_of = inverse[:base_count], inverse[base_count:]  # path id of each base node / chain prefix

    # node ids: a base node keeps its index; new paths follow per row, shallower first (parents before children)
    total = paths.shape[0]
    node_id = torch.full((total,), -1, dtype=torch.long, device=device)
    base_rows, base_nodes = base_valid.nonzero(as_tuple=True)
    node_id[base_of] = base_nodes
    path_rows = paths[:, 0]
    path_depths = (paths[:, 1:] != pad).sum(1) - 1
    fresh = node_id < 0
    order = torch.argsort(path_rows * (width + 1) + path_depths, stable=True)  # by row, then depth
    order = order[fresh[order]]
    fresh_rows = path_rows[order]
    per_row = torch.bincount(fresh_rows, minlength=batch)
    first = torch.cumsum(per_row, 0) - per_row
    node_id[order] = n + torch.arange(order.shape[0], device=device) - first[fresh_rows]
    size = n + int(per_row.max()) if order.numel() else n

    # the chain prefixes' rows, nodes, parents (the previous prefix, or the anchor), tokens and positions
    chain_rows, chain_index, steps = alive.nonzero(as_tuple=True)
    chain_nodes = node_id[chain_of]
    flat = torch.full((batch, chains, m), -1, dtype=torch.long, device=device)
    flat[chain_rows, chain_index, steps] = chain_nodes
    previous = flat[chain_rows, chain_index, (steps - 1).clamp(min=0)]
    chain_parents = torch.where(steps == 0, anchors[chain_rows, chain_index], previous)

    tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
    parents = torch.zeros_like(tokens)
    depths = torch.ones_like(tokens)
    valid = torch.zeros(batch, size, dtype=torch.bool, device=device)
    sources = torch.zeros_like(tokens)
    base_index = torch.full_like(tokens, -1)
    tokens[:, :n], parents[:, :n], depths[:, :n], valid[:, :n] = base.tokens, base.parents, base.depths, base.valid
    base_index[:, :n] = torch.arange(n, device=device)
    sources[:, :n] = torch.where(base.valid, base_source, 0)
    tokens[chain_rows, chain_nodes] = chain_tokens[chain_rows, chain_index, steps]
    parents[chain_rows, chain_nodes] = chain_parents
    depths[chain_rows, chain_nodes] = anchor_depths[chain_rows, chain_index] + 1 + steps
    valid[chain_rows, chain_nodes] = True
    sources[chain_rows, chain_nodes] |= chain_source
    chain_step = torch.zeros_like(tokens)
    chain_step = chain_step.view(-1).scatter_reduce(0, chain_rows * size + chain_nodes, steps + 1,
                                                     reduce="amax").view(batch, size)
    parents[:, 0], sources[:, 0], chain_step[:, 0], depths[:, 0] = -1, 0, 0, 0
    tree = BatchedTree(tokens, parents, depths, None, valid)
    return MergedTree(tree=tree, sources=sources, chain_step=chain_step, base_index=base_index)


def keep_nodes(tree: BatchedTree, keep: torch.BoolTensor, *extra: torch.Tensor) -> tuple[BatchedTree, ...]:
    """The sub-trees of the nodes in ``keep`` (`[B, n]`, closed under parents, the roots included), compacted to the
    widest row's count; rows with fewer nodes are padded with invalid nodes (children of the root). Node order is
    kept, so parents still come before children. ``extra`` per-node tensors (`[B, n]`) are gathered alongside
    (padding: 0)."""
    batch, n = tree.tokens.shape
    device = tree.tokens.device
    keep = keep & tree.valid
    keep[:, 0] = True
    nodes = torch.arange(n, device=device)[None].expand(batch, n)
    order = torch.sort(torch.where(keep, nodes, nodes + n), dim=1).values % n  # kept nodes first, in node order
    width = int(keep.sum(1).max())
    order = order[:, :width]
    kept = keep.gather(1, order)
    new_index = torch.zeros(batch, n, dtype=torch.long, device=device)
    new_index.scatter_(1, order, torch.arange(width, device=device)[None].expand(batch, width))
    parents = tree.parents.gather(1, order)
    parents = torch.where(parents >= 0, new_index.gather(1, parents.clamp(min=0)), parents)
    parents = torch.where(kept, parents, torch.zeros_like(parents))
    parents[:, 0] = -1
    tokens = torch.where(kept, tree.tokens.gather(1, order), torch.zeros_like(parents))
    depths = torch.where(kept, tree.depths.gather(1, order), torch.ones_like(parents))
    scores = None if tree.scores is None else torch.where(kept, tree.scores.gather(1, order), 0.0)
    out = BatchedTree(tokens, parents, depths, batched_ancestor_mask(parents), kept, scores)
    return (out, *(torch.where(kept, value.gather(1, order), torch.zeros_like(value.gather(1, order)))
                   for value in extra))
