"""Continuations copied from the context: n-gram (suffix) matching of tree paths against the tokens so far.

For every node of a draft tree, the sequence that node stands for is the context (prompt + generated tokens, the last
one being the root) followed by the node's path. Its last ``max_ngram`` tokens are looked up in the context: the
window whose trailing tokens agree with the longest suffix of that sequence (at least ``min_ngram`` tokens; among
equally long matches the one followed by the most tokens, up to ``num_tokens``, then the most recent) gives a
continuation, the ``num_tokens`` context tokens after it. Copying spans (extraction, summaries of a given text, code
edits, repeated phrases) makes such continuations likely tokens.

Pure tensor code, one row at a time and vectorised over nodes and context positions (``unfold`` + compare): no
generation imports, nothing here knows about acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MISSING = -2  # query positions before the start of the context (never equal to a token or to the padding)
_PAD = -1  # left padding of the context windows


@dataclass
class ContextMatches:
    """Continuations found for ``N`` query nodes.

    Attributes:
        tokens (`torch.LongTensor` of shape `[N, m]`): the continuation of each node (``m = num_tokens``).
        valid (`torch.BoolTensor` of shape `[N, m]`): which continuation tokens exist (a prefix of each row; all
            False where no window matched).
        lengths (`torch.LongTensor` of shape `[N]`): tokens of the matched suffix (0: no match).
    """

    tokens: torch.LongTensor
    valid: torch.BoolTensor
    lengths: torch.LongTensor


def node_paths(tokens: torch.LongTensor, depths: torch.LongTensor, tree_mask: torch.BoolTensor) -> torch.LongTensor:
    """`[n, D + 1]`: row ``i`` holds node ``i``'s root-to-node tokens at columns ``0..depths[i]`` (root first).

    Args:
        tokens, depths (`[n]`): node tokens and depths of one tree; tree_mask (`[n, n]`): ancestor-or-self.
    """
    n = tokens.shape[0]
    width = int(depths.max()) + 1 if n else 1
    paths = torch.zeros(n, width, dtype=torch.long, device=tokens.device)
    rows, cols = tree_mask.nonzero(as_tuple=True)
    paths[rows, depths[cols]] = tokens[cols]
    return paths


def suffix_queries(context: torch.LongTensor, paths: torch.LongTensor, depths: torch.LongTensor,
                   size: int) -> torch.LongTensor:  # fmt: skip
    """`[N, size]`: the last ``size`` tokens of ``context + path`` for every node, oldest first.

    Args:
        context (`[L]`): the tokens so far; ``context[-1]`` is the root (``paths[:, 0]``).
        paths (`[N, D + 1]`): `node_paths`; depths (`[N]`): node depths.
    """
    length = context.shape[0]
    offset = torch.arange(size - 1, -1, -1, device=context.device)  # distance from the node's own token
    index = depths[:, None] - offset[None, :]  # >= 1: a path column; <= 0: context position length - 1 + index
    from_path = paths.gather(1, index.clamp(min=0, max=paths.shape[1] - 1))
    context_pos = length - 1 + index
    from_context = context[context_pos.clamp(min=0, max=length - 1)]
    query = torch.where(index >= 1, from_path, from_context)
    return query.masked_fill(context_pos < 0, _MISSING)


def match_continuations(context: torch.LongTensor, queries: torch.LongTensor, num_tokens: int,
                        min_ngram: int | torch.LongTensor = 1) -> ContextMatches:  # fmt: skip
    """The continuation after the best earlier occurrence of each query's suffix in ``context``.

    A context position ``e`` (``e <= L - 2``, so that at least one token follows) matches query ``q`` over ``s``
    tokens when ``context[e - s + 1 : e + 1] == q[-s:]``. The longest match wins (ties: the one with the most tokens
    after it, up to ``num_tokens``, then the latest ``e``); matches shorter than ``min_ngram`` are ignored. One
    ``[N, L, size]`` comparison, no loop over nodes or positions.

    Args:
        context (`torch.LongTensor` of shape `[L]`): the tokens so far.
        queries (`torch.LongTensor` of shape `[N, size]`): `suffix_queries`.
        num_tokens: continuation length ``m``.
        min_ngram: shortest suffix accepted as a match, for every query or per query (`[N]`).
    """
    count, size = queries.shape
    length = context.shape[0]
    device = context.device
    padded = torch.cat([torch.full((size - 1,), _PAD, dtype=context.dtype, device=device), context])
    windows = padded.unfold(0, size, 1)  # [L, size]: window e ends at context position e
    equal = windows[None, :, :] == queries[:, None, :]  # [N, L, size]
    run = equal.flip(-1).long().cumprod(-1).sum(-1)  # [N, L] trailing agreement = matched suffix length
    run[:, max(length - 1, 0):] = 0  # the last position has no continuation (and is the query itself at the root)
    shortest = min_ngram[:, None].to(device) if isinstance(min_ngram, torch.Tensor) else min_ngram
    run = run.masked_fill(run < shortest, 0)
    positions = torch.arange(length, device=device)
    following = (length - 1 - positions).clamp(max=num_tokens)  # continuation tokens after each position
    # the longest match; among those, the one with the most continuation (up to num_tokens); then the latest
    best = ((run * (num_tokens + 1) + following[None, :]) * (length + 1) + positions[None, :]).argmax(dim=1)
    lengths = run.gather(1, best[:, None])[:, 0]
    index = best[:, None] + 1 + torch.arange(num_tokens, device=device)[None, :]  # [N, m]
    valid = (index < length) & (lengths[:, None] > 0)
    tokens = context[index.clamp(max=max(length - 1, 0))]
    return ContextMatches(tokens=tokens, valid=valid, lengths=lengths)


def context_continuations(context: torch.LongTensor, tokens: torch.LongTensor, depths: torch.LongTensor,
                          tree_mask: torch.BoolTensor, num_tokens: int, max_ngram: int = 3,
                          min_ngram: int = 1, root_min_ngram: int | None = None) -> ContextMatches:  # fmt: skip
    """Continuations from ``context`` (`[L]`, the root last) below every node of one tree (`[n]` tokens / depths,
    `[n, n]` ancestor-or-self mask): `match_continuations` of the nodes' `suffix_queries`. ``root_min_ngram`` (default
    ``min_ngram``) is the shortest match accepted for the root's own query."""
    if context.shape[0] < 2 or num_tokens < 1:
        n = tokens.shape[0]
        empty = torch.zeros(n, max(num_tokens, 0), dtype=torch.long, device=tokens.device)
        return ContextMatches(empty, empty.bool(), torch.zeros(n, dtype=torch.long, device=tokens.device))
    context = context.to(tokens.device)
    paths = node_paths(tokens, depths, tree_mask)
    queries = suffix_queries(context, paths, depths, max(max_ngram, 1))
    if root_min_ngram is not None and root_min_ngram != min_ngram:
        min_ngram = torch.full((tokens.shape[0],), min_ngram, dtype=torch.long, device=tokens.device)
        min_ngram[0] = root_min_ngram
    return match_continuations(context, queries, num_tokens, min_ngram)
