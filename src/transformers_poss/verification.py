"""Acceptance of a verified draft tree: which path the target keeps, and the token it adds itself.

The target has scored every node of a tree in one forward pass (``logits[i]`` is its next-token prediction after the
root-to-node-``i`` path). These functions pick the accepted path:

- greedy: the longest root-to-node path along which the target's argmax agrees with the node tokens, plus the
  target's argmax at the last accepted node (the bonus token);
- sampling: at the current node take the target distribution ``p`` after the logits processors, try the node's
  distinct children in order, accepting child ``x`` with probability ``p(x)`` (renormalised over what is left after
  earlier rejections); when every child is rejected, sample the bonus token from the residual distribution. As the
  children are deterministic draft picks, this reproduces the target distribution exactly.

All functions are pure: they read logits and trees and return new tensors. Loops run over tree depth at most, never
over all nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .tree import DraftTree


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


def _has_children(parents: torch.LongTensor, node: int) -> bool:
    return bool((parents == node).any().item())


def greedy_accept(tree: DraftTree, logits: torch.FloatTensor) -> TreeAcceptance:
    """Greedy acceptance without logits processors, fully vectorised.

    Args:
        tree: the verified tree (``n`` nodes).
        logits (`torch.FloatTensor` of shape `[n, vocab]`): target logits at every node.
    """
    argmax = logits.argmax(dim=-1)  # [n]
    parents = tree.parents
    # node i matches when its token is the target's choice after its parent; the root always matches
    match = tree.tokens == argmax[parents.clamp(min=0)]
    match[0] = True
    # a node is reachable when it and all its ancestors match
    reachable = ~(tree.tree_mask & ~match[None, :]).any(dim=-1)
    depth_if_reachable = torch.where(reachable, tree.depths, torch.full_like(tree.depths, -1))
    best = int(depth_if_reachable.argmax().item())
    path = tree.tree_mask[best].nonzero().squeeze(-1)  # ancestors come before descendants: index order = depth order
    tokens = torch.cat([tree.tokens[path[1:]], argmax[best : best + 1]])
    return TreeAcceptance(
        path=path, tokens=tokens, scores=logits[path], proposed_next=_has_children(parents, best)
    )


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
    token = int(torch.multinomial(residual, num_samples=1, generator=generator).item())
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
    if not do_sample and (logits_processor is None or len(logits_processor) == 0):
        return greedy_accept(tree, logits.float())
    if logits_processor is None:
        logits_processor = _identity
    return sequential_accept(tree, logits, prefix_ids, logits_processor, do_sample, generator)


def _identity(input_ids, scores):
    return scores


@dataclass
class AcceptanceStats:
    """Acceptance of a tree-speculative generation, one entry per verification round.

    Attributes:
        accepted_lengths (`list[int]`): tokens produced per round, i.e. accepted draft tokens + 1 (the bonus token).
        position_accepted (`list[int]`): at index ``i``, rounds whose draft token at position ``i + 1`` was accepted.
        position_proposed (`list[int]`): at index ``i``, rounds that proposed a draft token at position ``i + 1``
            after accepting positions ``1..i``.
        timings (`dict[str, float]`): seconds spent per phase (drafting, verification, acceptance, cache_update).
        rounds (`list`): per-round trees and accepted paths (`budget.RoundRecord`), when recording was asked for.
        fell_back_to_plain (`bool`): the automatic budget found that speculation does not pay on this machine and
            finished the call with plain decoding steps.
        plain_steps (`int`): decoding steps run by transformers' own loop after such a fallback (single-row loop).
            Each is one target forward producing one token, so each is also counted as a round of length 1 in
            ``accepted_lengths`` (``mean_acceptance_length`` stays tokens per target forward).
        tree_depths (`list[int]`): single-row loop only, aligned with ``accepted_lengths``: the depth of the tree
            verified in that round (with ``tree_total_tokens="auto"`` the depth the budget chose; 0 for a root-only
            round or a plain step after a fallback).
    """

    accepted_lengths: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    position_proposed: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    rounds: list = field(default_factory=list)
    fell_back_to_plain: bool = False
    plain_steps: int = 0
    tree_depths: list[int] = field(default_factory=list)

    def record(self, num_accepted: int, proposed_next: bool, depth: int | None = None) -> None:
        """Add one round that accepted ``num_accepted`` draft tokens (from a tree of ``depth``, when given)."""
        self.accepted_lengths.append(num_accepted + 1)
        if depth is not None:
            self.tree_depths.append(depth)
        reached = num_accepted + (1 if proposed_next else 0)
        while len(self.position_proposed) < reached:
            self.position_proposed.append(0)
            self.position_accepted.append(0)
        for i in range(reached):
            self.position_proposed[i] += 1
        for i in range(num_accepted):
            self.position_accepted[i] += 1

    def record_plain_steps(self, count: int) -> None:
        """Add ``count`` steps of plain decoding (one token per target forward, nothing drafted)."""
        self.plain_steps += count
        self.accepted_lengths += [1] * count
        self.tree_depths += [0] * count

    def add_time(self, phase: str, seconds: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    @property
    def num_rounds(self) -> int:
        return len(self.accepted_lengths)

    @property
    def accepted_draft_tokens(self) -> list[int]:
        """Accepted draft tokens per round (``accepted_lengths`` without the +1)."""
        return [n - 1 for n in self.accepted_lengths]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target verification forward, bonus token included (+1 convention); 0.0 before any round."""
        if not self.accepted_lengths:
            return 0.0
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    @property
    def position_acceptance(self) -> list[float]:
        """Rate at draft position ``i + 1`` given positions ``1..i`` accepted (index 0 = position 1)."""
        return [a / p if p else 0.0 for a, p in zip(self.position_accepted, self.position_proposed)]

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """Combine two runs (e.g. over many prompts) into a new object."""
        out = AcceptanceStats(accepted_lengths=self.accepted_lengths + other.accepted_lengths)
        size = max(len(self.position_proposed), len(other.position_proposed))
        for name in ("position_accepted", "position_proposed"):
            a, b = getattr(self, name), getattr(other, name)
            setattr(out, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(size)])
        for phase in set(self.timings) | set(other.timings):
            out.timings[phase] = self.timings.get(phase, 0.0) + other.timings.get(phase, 0.0)
        out.rounds = self.rounds + other.rounds
        out.fell_back_to_plain = self.fell_back_to_plain or other.fell_back_to_plain
        out.plain_steps = self.plain_steps + other.plain_steps
        out.tree_depths = self.tree_depths + other.tree_depths
        return out
