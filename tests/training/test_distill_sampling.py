"""Sampled data generation: tokens drawn among the top-k candidates inside a logits processor follow transformers'
temperature -> top-k -> top-p distribution."""

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from transformers_poss.training.distill import SampleAmongCandidates
from tree_testing import chi_square_p_value, one_thread  # noqa: F401 - autouse fixture

V = 12
DRAWS = 30000


def _reference(logits, temperature, top_k, top_p):
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) + [TopPLogitsWarper(top_p)]
    warpers = LogitsProcessorList(warpers)
    return warpers(None, logits.clone()).softmax(dim=-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 6, 0.9), (0.7, 4, 1.0), (1.4, 12, 0.6), (1.0, 0, 0.8)])
def test_draws_follow_the_warped_distribution(temperature, top_k, top_p):
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4))
    processor = SampleAmongCandidates(temperature, top_p, top_k=top_k)
    torch.manual_seed(0)
    out = processor(None, logits.expand(DRAWS, V).clone())
    assert bool((out.isfinite().sum(-1) == 1).all()) and bool((out.max(-1).values == 0).all())
    counts = torch.bincount(out.argmax(-1), minlength=V)
    expected = _reference(logits, temperature, top_k, top_p)[0]
    assert bool((counts[expected == 0] == 0).all())  # nothing outside top-k / top-p
    assert chi_square_p_value(counts, expected) > 1e-3
    # negative control: without top-p the same draws are far from the warped distribution
    if top_p < 1.0:
        assert chi_square_p_value(counts, _reference(logits, temperature, top_k, 1.0)[0]) < 1e-6
