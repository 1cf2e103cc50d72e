"""Acceptance of one node's sampled children: the optimum against every token subset, the recursive rule against
the rejection sampler itself; the sampler of a row's final token."""

import itertools

import pytest
import torch

from transformers_poss.speculation.acceptance_bounds import (draws_without_replacement, optimal_acceptance,
                                                             recursive_acceptance, top_k_acceptance)
from transformers_poss.speculation.rejection import recursive_rejection_sample, sample_rows
from tree_testing import chi_square_p_value

V = 5


def distributions(seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.full((V,), 0.6)).sample() if seed % 2 else torch.rand(V, generator=gen) ** 3
    q = torch.rand(V, generator=gen) ** 2
    if seed >= 2:  # a token the draft cannot propose (outside a reduced draft vocabulary)
        q[seed % V] = 0.0
    return (p / p.sum()).double(), (q / q.sum()).double()


def exact_optimum(p, q, k) -> float:
    """``min_H p(H) + 1 - P(all k draws in H)`` over EVERY subset H, the draws' law enumerated exactly."""
    inside = {}
    for tup in itertools.permutations(range(V), k):
        chance, left = 1.0, 1.0
        for x in tup:
            chance *= float(q[x]) / left
            left -= float(q[x])
        inside[tup] = chance
    best = 1.0
    for size in range(V + 1):
        for subset in itertools.combinations(range(V), size):
            all_in = sum(c for tup, c in inside.items() if set(tup) <= set(subset))
            best = min(best, float(p[list(subset)].sum()) + 1.0 - all_in)
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_optimum_matches_the_minimum_over_every_subset(seed, k):
    p, q = distributions(seed)
    gen = torch.Generator().manual_seed(seed)
    assert optimal_acceptance(p, q, k, samples=40_000, generator=gen) == pytest.approx(exact_optimum(p, q, k),
                                                                                      abs=0.012)


@pytest.mark.parametrize("seed", range(4))
def test_the_recursive_rule_reaches_one_draft_optimum_and_stays_below_it_with_more(seed):
    p, q = distributions(seed)
    gen = torch.Generator().manual_seed(seed)
    one = float(torch.minimum(p, q).sum())  # one draft: the classic optimum
    assert recursive_acceptance(p, q, 1, samples=40_000, generator=gen) == pytest.approx(one, abs=0.01)
    for k in (2, 3):
        recursive = recursive_acceptance(p, q, k, samples=20_000, generator=gen)
        assert recursive <= optimal_acceptance(p, q, k, samples=20_000, generator=gen) + 0.012
        assert recursive >= recursive_acceptance(p, q, k - 1, samples=20_000, generator=gen) - 0.012
    assert top_k_acceptance(p, q, 2) == pytest.approx(float(p[q.topk(2).indices].sum()))


def test_the_recursive_estimate_is_what_the_rejection_sampler_accepts():
    p, q = distributions(1)
    gen = torch.Generator().manual_seed(0)
    n, k = 40_000, 3
    children = draws_without_replacement(q, k, n, gen)
    choice, _ = recursive_rejection_sample(p.float().expand(n, -1), q.float().expand(n, -1), children,
                                           torch.ones(n, k, dtype=torch.bool), gen)  # fmt: skip
    measured = float((choice >= 0).double().mean())
    assert recursive_acceptance(p, q, k, samples=40_000, generator=gen) == pytest.approx(measured, abs=0.012)


def test_sample_rows_draws_multinomially_and_never_a_zero_weight():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 5.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_rows(weights, gen) for _ in range(8000)])  # [runs, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6).double()
        assert counts[weights[row] == 0].sum() == 0
        assert chi_square_p_value(counts, weights[row].double() / weights[row].sum()) > 1e-3


def test_the_example_that_measures_the_bounds_imports_and_parses():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "acceptance_bound.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--temperature" in done.stdout
