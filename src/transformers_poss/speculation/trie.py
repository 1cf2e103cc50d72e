"""One tree from several sources: token chains grafted below tree nodes, identical prefixes merged (a trie).

A node of a draft tree stands for a token path; a continuation found elsewhere (e.g. copied from the context,
`context_match`) is a chain of tokens below some node. Grafting inserts each chain into the tree as into a trie: a
chain token that equals a child already there (drafted, or added by an earlier chain) reuses that node, so every path
appears once and siblings never repeat a token. Each node records which sources proposed it (a bit mask).

Pure tensor code for B rows, vectorised over rows and chains; the only loop runs over chain positions (the chain
length), never over nodes. Nothing here knows about acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import BatchedTree, batched_ancestor_mask

DRAFT_SOURCE = 1  # bit of ``sources``: the draft network proposed the node
CONTEXT_SOURCE = 2  # bit of ``sources``: a continuation copied from the context passes through the node
CHAIN_START = 4  # bit of ``sources`` (with CONTEXT_SOURCE): the node is the first token of such a continuation
SOURCE_NAMES = {DRAFT_SOURCE: "draft", CONTEXT_SOURCE: "context"}  # the sources reported in statistics


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
        a `MergedTree`: the base nodes first (same indices), then the new nodes in order of chain position. A chain
        token equal to an existing child of its parent (base or grafted) reuses that node and marks it with
        ``chain_source``; identical chain prefixes become one node.
    """
    batch, n = base.tokens.shape
    chains, m = chain_tokens.shape[1], chain_tokens.shape[2]
    device = base.tokens.device
    capacity = n + chains * m  # node ids per row never reach this
    vocab = int(max(int(base.tokens.max()), int(chain_tokens.max()) if chain_tokens.numel() else 0)) + 1
    row_ids = torch.arange(batch, device=device)

    def key(rows, parents, tokens):  # one int64 per (row, parent, token) edge
        return (rows * capacity + parents) * vocab + tokens

    node_rows = row_ids[:, None].expand(batch, n)
    edge = base.valid.clone()
    edge[:, 0] = False
    table_keys = key(node_rows, base.parents.clamp(min=0), base.tokens)[edge]
    table_ids = torch.arange(n, device=device)[None].expand(batch, n)[edge]
    order = torch.argsort(table_keys)
    table_keys, table_ids = table_keys[order], table_ids[order]

    counts = torch.full((batch,), n, dtype=torch.long, device=device)  # next free id per row
    new_rows, new_ids, new_parents, new_tokens = [], [], [], []
    chain_marks = []  # (row, id) of every node a chain passes through
    current = anchors.clone()
    alive = torch.ones_like(anchors, dtype=torch.bool)
    chain_rows = row_ids[:, None].expand(batch, chains)
    for j in range(m):
        alive = alive & chain_valid[:, :, j]
        if not bool(alive.any()):
            break
        rows, parents, tokens = chain_rows[alive], current[alive], chain_tokens[:, :, j][alive]
        keys = key(rows, parents, tokens)
        if table_keys.numel():
            pos = torch.searchsorted(table_keys, keys).clamp(max=table_keys.numel() - 1)
            found = table_keys[pos] == keys
            ids = torch.where(found, table_ids[pos], torch.zeros_like(pos))
        else:
            found = torch.zeros_like(keys, dtype=torch.bool)
            ids = torch.zeros_like(keys)
        if bool((~found).any()):
            fresh, inverse = torch.unique(keys[~found], return_inverse=True)  # sorted: grouped by row
            fresh_rows = fresh // (capacity * vocab)
            per_row = torch.bincount(fresh_rows, minlength=batch)
            first = torch.cumsum(per_row, 0) - per_row
            fresh_ids = counts[fresh_rows] + torch.arange(fresh.numel(), device=device) - first[fresh_rows]
            counts = counts + per_row
            ids[~found] = fresh_ids[inverse]
            new_rows.append(fresh_rows)
            new_ids.append(fresh_ids)
            new_parents.append((fresh // vocab) % capacity)
            new_tokens.append(fresh % vocab)
            table_keys = torch.cat([table_keys, fresh])
            table_ids = torch.cat([table_ids, fresh_ids])
            order = torch.argsort(table_keys)
            table_keys, table_ids = table_keys[order], table_ids[order]
        chain_marks.append((rows, ids))
        current = current.clone()
        current[alive] = ids

    size = int(counts.max())
    tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
    parents = torch.zeros_like(tokens)
    valid = torch.zeros(batch, size, dtype=torch.bool, device=device)
    sources = torch.zeros_like(tokens)
    base_index = torch.full_like(tokens, -1)
    tokens[:, :n], parents[:, :n], valid[:, :n] = base.tokens, base.parents, base.valid
    base_index[:, :n] = torch.arange(n, device=device)
    sources[:, :n] = torch.where(base.valid, base_source, 0)
    if new_rows:
        rows, ids = torch.cat(new_rows), torch.cat(new_ids)
        tokens[rows, ids], parents[rows, ids], valid[rows, ids] = torch.cat(new_tokens), torch.cat(new_parents), True
    chain_step = torch.zeros_like(tokens)
    for j, (rows, ids) in enumerate(chain_marks):  # later positions overwrite earlier ones
        sources[rows, ids] |= chain_source
        chain_step[rows, ids] = j + 1
    parents[:, 0] = -1
    sources[:, 0] = 0
    depths = torch.zeros_like(tokens)
    for _ in range(int(base.depths.max()) + len(chain_marks) if size > 1 else 0):  # depth by propagation: <= D + m
        updated = torch.where(parents >= 0, depths.gather(1, parents.clamp(min=0)) + 1, depths)
        if torch.equal(updated, depths):
            break
        depths = updated
    depths = torch.where(valid | (torch.arange(size, device=device) == 0), depths, torch.ones_like(depths))
    parents = torch.where(valid | (torch.arange(size, device=device) == 0), parents, torch.zeros_like(parents))
    chain_step[:, 0] = 0
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
