"""Acceptance for B rows verified in one forward: each row keeps its own path.

Greedy decoding without logits processors is fully vectorised over rows and nodes; sampling and processors reuse the
single-row `verification.sequential_accept` row by row (its loop runs over depth, never over nodes), on the row's
valid nodes and with the row's own sequence as the processors' prefix.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from .tree import BatchedTree
from .verification import sequential_accept, _identity


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

    def row_tokens(self, b: int) -> torch.LongTensor:
        return self.tokens[b, self.width - int(self.counts[b]) :]


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


# processor attributes that hold one entry per batch row (sliced to the row for row-by-row acceptance)
BATCH_ATTRIBUTES = ("prompt_ignore_length",)


def row_processors(logits_processor, batch_size: int) -> list:
    """One processor list per row: batch-shaped state (e.g. the repetition penalty's per-row padding length) sliced
    to that row, so a processor sees a `[1, L]` row exactly as it sees that row inside the batch."""
    if logits_processor is None or len(logits_processor) == 0:
        return [_identity] * batch_size
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
    return per_row_accept(tree, logits, prefixes(), processors, do_sample)
