"""How often a node's sampled children can be accepted: the recursive rule, the target-only rule and the optimum.

For ``k`` children drawn without replacement from the draft's ``q`` and the target's ``p`` at one node, the most any
verification rule that keeps ``p`` exactly can accept is the optimal transport between draft tuples and output tokens,
whose dual (Hu et al. 2025, "Towards Optimal Multi-draft Speculative Decoding") reads

    alpha*(k) = min over token sets H of  p(H) + 1 - P(all k draws fall in H).

The minimum is reached among the sets ``H_j`` of the ``j`` tokens with the highest ``q / p`` (on random small
vocabularies this family gives the linear program's optimum exactly; ``tests/speculation/test_acceptance_bounds.py``
checks it against every subset). ``P(all draws in H_j)`` is estimated from Gumbel-top-k samples: the draws all fall
in ``H_j`` exactly when the highest ``q / p`` rank among them is below ``j``.

Everything here is pure, for one node (`[V]` distributions), and meant for analysis (`examples/acceptance_bound.py`),
not for the decoding loop.
"""

from __future__ import annotations

import torch

from .rejection import gumbel_top_k, residual_distribution


def _on_support(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``p`` and ``q`` (float64, normalised) on the tokens ``q`` can draw, plus one token holding ``p``'s mass outside
    them: exact for every quantity here (``q`` is 0 on all of them, so residuals and sets treat them alike)."""
    p, q = p.double() / p.sum(), q.double() / q.sum()
    inside = q > 0
    return torch.cat([p[inside], p[~inside].sum().view(1)]), torch.cat([q[inside], q.new_zeros(1)])


def draws_without_replacement(q: torch.Tensor, k: int, samples: int, generator: torch.Generator | None = None):
    """`[samples, k]` draws without replacement from ``q`` (`[V]`), in draw order (Gumbel-top-k)."""
    logq = q.double().clamp(min=1e-300).log().masked_fill(q <= 0, float("-inf"))
    return gumbel_top_k(logq.float().expand(samples, -1), k, generator)[0]


def top_k_acceptance(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """The target-only rule with the draft's deterministic top-``k`` as children: ``p`` of those ``k`` tokens."""
    return float(p[q.topk(k).indices].sum())


def recursive_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, samples: int = 1000,
                         generator: torch.Generator | None = None) -> float:  # fmt: skip
    """Expected acceptance of the recursive rule (`rejection.recursive_rejection_sample`) over ``k`` children drawn
    without replacement from ``q``: exact given the draws (each child's acceptance probability, not a coin flip),
    averaged over ``samples`` draws."""
    p, q = _on_support(p, q)
    draws = draws_without_replacement(q, k, samples, generator)
    target, draft = p.expand(samples, -1).clone(), q.expand(samples, -1).clone()
    reach, accepted = torch.ones(samples, dtype=torch.float64), torch.zeros(samples, dtype=torch.float64)
    for i in range(k):
        token = draws[:, i : i + 1]
        chance = (target.gather(1, token) / draft.gather(1, token).clamp(min=1e-300)).clamp(max=1.0)[:, 0]
        accepted += reach * chance
        reach = reach * (1.0 - chance)
        target = residual_distribution(target, draft)
        draft = draft.scatter(1, token, 0.0)
        draft = draft / draft.sum(dim=1, keepdim=True).clamp(min=1e-300)
    return float(accepted.mean())


def optimal_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, samples: int = 1000,
                       generator: torch.Generator | None = None) -> float:  # fmt: skip
    """``alpha*(k)``: the most any exact rule can accept with ``k`` children drawn without replacement from ``q``."""
    p, q = _on_support(p, q)
    order = torch.argsort(q / p.clamp(min=1e-300), descending=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    p_prefix = torch.cat([p.new_zeros(1), p[order].cumsum(0)])  # p(H_j), j = 0 .. V
    highest = rank[draws_without_replacement(q, k, samples, generator)].max(dim=1).values  # all in H_j iff < j
    inside = torch.cat([p.new_zeros(1), torch.bincount(highest, minlength=p.numel()).cumsum(0).double() / samples])
    return float((p_prefix + 1.0 - inside).min())
