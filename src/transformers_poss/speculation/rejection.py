"""Recursive rejection sampling of sampled children (``tree_sampling="draft_probabilities"``).

A node's children ``x_1 .. x_m`` were drawn WITHOUT replacement from the draft's distribution ``q`` (Gumbel-top-k,
`gumbel_top_k`), in that order. The target keeps its own distribution ``p`` exactly with the recursive rule
(Recursive Speculative Decoding, Jeon et al. 2024):

- ``p_1 = p``, ``q_1 = q``;
- child ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``;
- on rejection ``p_{i+1} = norm(max(p_i - q_i, 0))`` (`residual_distribution`) and ``q_{i+1}`` is ``q_i`` with
  ``x_i`` removed and renormalised (the distribution ``x_{i+1}`` was drawn from);
- when every child is rejected the token is drawn from ``p_{m+1}``.

Each step is the one-draft rejection step with target ``p_i`` and proposal ``q_i``, and ``x_i`` is distributed as
``q_i`` given the earlier draws, so by induction from the last step the token is distributed as ``p``. The number of
children of a node must not depend on that node's own draws (`sampled_drafter` fixes it before drawing).

Everything here is pure and works on one flat batch of ``N`` nodes (rows of several trees at once).
"""

from __future__ import annotations

import torch


def gumbel_top_k(logprobs: torch.Tensor, k: int, generator: torch.Generator | None = None):
    """``k`` draws without replacement from ``softmax(logprobs)``, in draw order (Gumbel-top-k).

    Args:
        logprobs (`torch.FloatTensor` of shape `[..., V]`): log-probabilities (``-inf`` outside the support).
        k: draws per distribution.

    Returns:
        `(indices, logprobs)`, each `[..., k]`: the drawn indices and their log-probabilities under ``logprobs``
        (``-inf`` for draws past the support, which are not real draws).
    """
    uniform = torch.rand(logprobs.shape, generator=generator, device=logprobs.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
    indices = (logprobs.float() + gumbel).topk(k, dim=-1).indices
    return indices, logprobs.gather(-1, indices)


def sample_rows(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One draw per row of `[N, V]` non-negative weights (not necessarily normalised), by inverting the float64
    cumulative sum with one uniform per row: the law of ``torch.multinomial(weights, 1)``, about 18x faster on a CPU
    for a 49k vocabulary (0.09 ms against 1.5 ms). A zero-weight token is never drawn."""
    cdf = weights.double().cumsum(dim=-1)
    u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device, dtype=torch.float64)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    last = weights.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)  # u * total rounded up to total
    return torch.minimum(drawn, last)


def residual_distribution(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """``norm(max(target - draft, 0))`` over the last dimension (`[N, V]`); rows with no mass left stay ``target``
    (they cannot be reached: a rejection there has probability 0)."""
    draft_mass = draft.sum(dim=-1)
    residual = residual_weights(target, draft, target.sum(dim=-1), draft_mass)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 1e-12 * draft_mass[:, None], residual / mass.clamp(min=1e-30), target)


def residual_weights(target: torch.Tensor, draft: torch.Tensor, target_mass: torch.Tensor,
                     draft_mass: torch.Tensor) -> torch.Tensor:
    """Weights `[N, V]` proportional to ``max(target / target_mass - draft / draft_mass, 0)``: the residual of
    `residual_distribution` for unnormalised weights and their masses `[N]`, without normalising (scaled by
    ``draft_mass``, so the weights stay of the order of the draft's)."""
    scale = (draft_mass / target_mass.clamp(min=1e-30))[:, None]
    return torch.mul(target, scale).sub_(draft).clamp_(min=0.0)


def recursive_rejection_sample(
    target_probs: torch.FloatTensor,
    draft_probs: torch.FloatTensor,
    child_tokens: torch.LongTensor,
    child_valid: torch.BoolTensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Recursive rejection sampling over the sampled children of ``N`` nodes at once.

    Args:
        target_probs (`torch.FloatTensor` of shape `[N, V]`): the target's distribution at each node (after the
            logits processors).
        draft_probs (`torch.FloatTensor` of shape `[N, V']`, ``V' <= V``): the draft's distribution the children
            were drawn from (zero past ``V'``).
        child_tokens (`torch.LongTensor` of shape `[N, k]`): each node's children in draw order.
        child_valid (`torch.BoolTensor` of shape `[N, k]`): real children (a prefix of each row).

    Returns:
        `(choice, token)`, each `[N]`: the index of the accepted child (``-1`` when all were rejected) and the
        emitted token (the accepted child, or a draw from the final residual).

    The loop runs over the ``k`` child slots (at most ``tree_top_k``); every step is vectorised over the ``N`` nodes.
    ``p_i`` and ``q_i`` are kept as unnormalised weights with their masses `[N]` (a removed child only lowers the
    draft's mass, a rejection costs one pass over the vocabulary for the residual and one for its mass), the loop
    stops once no node is still trying a child, and the final residual is drawn from only for the nodes that
    rejected every child.
    """
    p = target_probs.float()
    q = draft_probs.float()
    if q.shape[-1] < p.shape[-1]:
        q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    n, k = child_tokens.shape
    p_mass, q_mass = p.sum(dim=-1), q.sum(dim=-1)  # [N]
    choice = torch.full((n,), -1, dtype=torch.long, device=p.device)
    uniforms = torch.rand(n, max(k, 1), generator=generator, device=p.device)
    searching = torch.ones(n, dtype=torch.bool, device=p.device)
    q_owned = False  # q is copied before its first in-place removal
    for i in range(k):
        token = child_tokens[:, i : i + 1]
        q_token = q.gather(1, token)[:, 0]
        trying = searching & child_valid[:, i] & (q_token > 0)
        if not bool(trying.any()):  # children are a prefix of each row and ``searching`` only shrinks
            break
        ratio = p.gather(1, token)[:, 0] * q_mass / (q_token * p_mass).clamp(min=1e-30)  # p_i(x) / q_i(x)
        accepted = trying & (uniforms[:, i] < ratio)
        choice = torch.where(accepted, i, choice)
        searching = searching & ~accepted
        rejected = trying & ~accepted
        if not bool(rejected.any()):
            continue
        residual = residual_weights(p, q, p_mass, q_mass)
        residual_mass = residual.sum(dim=-1)
        # a residual without mass cannot be reached (a rejection there has probability 0): such rows keep p
        moved = rejected & (residual_mass > 1e-12 * q_mass)
        p = residual if bool(moved.all()) else torch.where(moved[:, None], residual, p)
        p_mass = torch.where(moved, residual_mass, p_mass)
        if not q_owned:
            q, q_owned = q.clone(), True
        q.scatter_(1, token, torch.where(rejected, 0.0, q_token)[:, None])  # q_{i+1}: x_i removed where rejected
        q_mass = torch.where(rejected, q_mass - q_token, q_mass).clamp_(min=0.0)
    redraw = choice < 0
    if bool(redraw.all()):
        return choice, sample_rows(p, generator)
    token = child_tokens.gather(1, choice.clamp(min=0)[:, None])[:, 0]
    if bool(redraw.any()):
        token[redraw] = sample_rows(p[redraw], generator)
    return choice, token
