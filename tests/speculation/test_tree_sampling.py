"""Sampled trees (``tree_sampling="draft_probabilities"``): Gumbel-top-k draws, the recursive rejection rule with p
and q, and the sampled drafter's shape, checked against exact distributions (with a wrong residual as control)."""

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from transformers_poss import PosSDraftConfig, PosSDraftModel
from transformers_poss.speculation import rejection
from transformers_poss.speculation.acceptance import identity_processor, sampled_accept
from transformers_poss.speculation.rejection import gumbel_top_k, recursive_rejection_sample
from transformers_poss.speculation.sampled_drafter import (DraftWarping, SampledTreeProposer, level_sizes,
                                                           tree_sampling_mode)
from tree_testing import chi_square_p_value, one_thread, tiny_llama_target  # noqa: F401 - autouse fixture

ALPHA = 1e-3
V = 6
P = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])
CASES = {  # draft distributions q against P, children per node
    "skewed": (torch.tensor([0.05, 0.1, 0.5, 0.25, 0.1, 0.0]), 3),
    "close": (torch.tensor([0.28, 0.27, 0.2, 0.1, 0.1, 0.05]), 2),
    "support-smaller-than-k": (torch.tensor([0.0, 0.0, 0.7, 0.3, 0.0, 0.0]), 4),
    "one-child": (torch.tensor([0.6, 0.1, 0.1, 0.1, 0.05, 0.05]), 1),
}


def _sample(q, k, draws=40000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    children, logq = gumbel_top_k(q.log()[None].expand(draws, V), k, gen)
    choice, token = recursive_rejection_sample(P[None].expand(draws, V), q[None].expand(draws, V), children,
                                               torch.isfinite(logq), gen)  # fmt: skip
    return choice, token


def test_gumbel_top_k_draws_without_replacement_in_draw_order():
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    children, logq = gumbel_top_k(q.log()[None].expand(30000, 4), 2, torch.Generator().manual_seed(1))
    assert bool((children[:, 0] != children[:, 1]).all())
    assert torch.allclose(logq, q.log()[children])
    assert chi_square_p_value(torch.bincount(children[:, 0], minlength=4), q) > ALPHA
    second = torch.stack([q * q[j] / (1 - q[j]) for j in range(4)]).sum(0) - q * q / (1 - q)  # P(x_2 = y)
    assert chi_square_p_value(torch.bincount(children[:, 1], minlength=4), second) > ALPHA


@pytest.mark.parametrize("case", sorted(CASES))
def test_recursive_rejection_keeps_the_target_distribution(case):
    q, k = CASES[case]
    choice, token = _sample(q, k)
    counts = torch.bincount(token, minlength=V).double()
    assert chi_square_p_value(counts, P) > ALPHA
    assert float((counts / counts.sum() - P).abs().sum() / 2) < 0.01  # total variation
    assert bool((choice >= 0).any())


def test_residual_weights_are_the_normalised_residual_up_to_scale():
    gen = torch.Generator().manual_seed(3)
    p, q = torch.rand(5, 50, generator=gen), torch.rand(5, 50, generator=gen)
    q[:, 30:] = 0.0  # a draft support smaller than the vocabulary
    expected = (p / p.sum(-1, keepdim=True) - q / q.sum(-1, keepdim=True)).clamp(min=0)
    expected = expected / expected.sum(-1, keepdim=True)
    weights = rejection.residual_weights(p, q, p.sum(-1), q.sum(-1))
    assert bool((weights >= 0).all()) and bool((weights[:, :30] == 0).any())
    torch.testing.assert_close(weights / weights.sum(-1, keepdim=True), expected)


def test_a_residual_without_mass_keeps_the_target(monkeypatch):
    """A residual that rounds to no mass (unreachable in exact arithmetic) must not turn into a draw from zero
    weights: the node keeps p, so every emitted token stays in p's support."""
    monkeypatch.setattr(rejection, "residual_weights", lambda target, draft, *masses: torch.zeros_like(target))
    p, q = torch.tensor([0.4, 0.3, 0.3, 0.0]), torch.tensor([0.1, 0.1, 0.2, 0.6])
    gen = torch.Generator().manual_seed(0)
    children, logq = gumbel_top_k(q.log()[None].expand(4000, 4), 2, gen)
    choice, token = recursive_rejection_sample(p[None].expand(4000, 4), q[None].expand(4000, 4), children,
                                               torch.isfinite(logq), gen)  # fmt: skip
    assert bool((choice < 0).any())
    assert int(token.max()) < 3


def test_a_wrong_residual_fails_the_same_test(monkeypatch):
    """Negative control: keeping p after a rejection (instead of norm(max(p - q_i, 0))) is caught."""
    monkeypatch.setattr(rejection, "residual_weights", lambda target, draft, *masses: target)
    for case in ("skewed", "close"):
        q, k = CASES[case]
        _, token = _sample(q, k)
        assert chi_square_p_value(torch.bincount(token, minlength=V), P) < ALPHA


def test_tree_sampling_mode_is_checked():
    class Config:
        tree_sampling = None

    config = Config()
    assert tree_sampling_mode(config) == "target_only"
    config.tree_sampling = "draft_probabilities"
    assert tree_sampling_mode(config) == "draft_probabilities"
    config.tree_sampling = "draft"
    with pytest.raises(ValueError, match="'target_only', 'draft_probabilities'"):
        tree_sampling_mode(config)


def test_draft_warping_matches_the_target_warpers():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(8), TopPLogitsWarper(0.8)])
    expected = torch.log_softmax(warpers(None, logits.clone()), dim=-1)
    assert torch.allclose(DraftWarping(0.7, 8, 0.8)(logits), expected, atol=1e-6)


@pytest.mark.parametrize("settings", [(0.7, 8, 0.8), (1.0, 5, None), (1.3, 12, 0.5), (0.8, 50, 0.95)])
def test_draft_warping_candidates_are_the_same_distribution(settings):
    logits = 3 * torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    warping = DraftWarping(*settings)
    logprobs, ids = warping.candidates(logits)
    assert ids.shape == (64, settings[1])
    scattered = torch.full_like(logits, float("-inf")).scatter(-1, ids, logprobs)
    assert torch.allclose(scattered.exp(), warping(logits).exp(), atol=1e-6)
    with pytest.raises(ValueError, match="top_k"):
        DraftWarping(1.0, None, 0.9).candidates(logits)


def test_level_sizes():
    assert level_sizes(4, 4, 16) == [4, 4, 4, 3]
    assert level_sizes(6, 10, 60) == [10, 10, 10, 10, 10, 9]
    assert level_sizes(5, 1, 16) == [1, 1, 1, 1, 1]  # a chain
    assert level_sizes(3, 2, 60) == [2, 4, 4]  # never wider than top_k frontier nodes x top_k children
    assert sum(level_sizes(3, 3, 8)) == 7


# ---------------------------------------------------------------- the sampled drafter and acceptance, many rows at once

SMALL = 8
ROWS = 6000
TREE_CASES = {  # (depth, top_k, total), processors (the draft applies the same temperature / top-k / top-p)
    "d3-k3-8": ((3, 3, 8), {}),
    "d4-k2-9-temperature-top-k": ((4, 2, 9), {"temperature": 0.7, "top_k": 5}),
    "d3-k4-12-top-p": ((3, 4, 12), {"temperature": 1.3, "top_p": 0.8}),
}


@pytest.fixture(scope="module")
def tiny_draft():
    target = tiny_llama_target(vocab_size=SMALL, seed=3)
    torch.manual_seed(1)
    config = PosSDraftConfig.for_target(target.config, num_specialists=2, positions_per_specialist=1)
    return PosSDraftModel(config).eval().attach_target(target)


def _processors(settings):
    warpers = []
    if "temperature" in settings:
        warpers.append(TemperatureLogitsWarper(settings["temperature"]))
    if "top_k" in settings:
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    return LogitsProcessorList(warpers) if warpers else identity_processor


def _markov_target(seed=7):
    """Target logits that depend on (depth, last token): `[depth, token, vocab]`."""
    return torch.randn(6, SMALL, SMALL, generator=torch.Generator().manual_seed(seed)) * 1.5


def _sampled_rows(draft, shape, settings, rows=ROWS, seed=0):
    depth, top_k, total = shape
    proposer = SampledTreeProposer(draft, depth, top_k, total, DraftWarping(**settings),
                                   torch.Generator().manual_seed(seed))  # fmt: skip
    features = torch.randn(1, 3, draft.config.hidden_size, generator=torch.Generator().manual_seed(2))
    proposer.append(torch.tensor([[4, 1, 6]]).expand(rows, 3), features.expand(rows, -1, -1))
    positions = torch.arange(3)[None].expand(rows, 3)
    tree = proposer.propose_batch(torch.ones(rows, 3, dtype=torch.bool), positions)
    table = _markov_target()
    logits = table[tree.depths, tree.tokens]  # [B, n, V]
    processors = _processors(settings)
    torch.manual_seed(seed)
    accepted, _ = sampled_accept(tree, logits, [torch.tensor([[6]])] * rows, [processors] * rows)
    return tree, accepted, table, processors


def _exact_joint(table, processors):
    probs = lambda logits: torch.softmax(processors(None, logits.clone()), dim=-1)  # noqa: E731
    first = probs(table[0, 6][None])[0]
    second = probs(table[1])  # [t1, t2]
    third = probs(table[2])  # [t2, t3]
    return first[:, None, None] * second[:, :, None] * third[None]


def _first_three(accepted):
    """`[B, 3]` the first three emitted tokens of rows that emitted three (others: -1)."""
    start = accepted.width - accepted.counts
    cols = (start[:, None] + torch.arange(3)[None]).clamp(max=accepted.width - 1)
    tokens = accepted.tokens.gather(1, cols)
    return torch.where(accepted.counts[:, None] > torch.arange(3)[None], tokens, -1)


@pytest.mark.parametrize("case", sorted(TREE_CASES))
def test_sampled_trees_keep_the_target_distribution(tiny_draft, case):
    shape, settings = TREE_CASES[case]
    tree, accepted, table, processors = _sampled_rows(tiny_draft, shape, settings)
    depth, top_k, total = shape
    assert tree.num_nodes == 1 + sum(level_sizes(depth, top_k, total))
    assert int(accepted.counts.max()) >= 3  # depth-2 acceptances happened
    joint = _exact_joint(table, processors)
    first = torch.bincount(accepted.tokens[torch.arange(ROWS), accepted.width - accepted.counts], minlength=SMALL)
    assert chi_square_p_value(first, joint.sum((1, 2))) > ALPHA
    three = _first_three(accepted)
    two = three[:, 1] >= 0  # rows that accepted a depth-1 child: (t1, t2) must follow p(t1) p(t2 | t1) given t1
    pairs = torch.bincount(three[two, 0] * SMALL + three[two, 1], minlength=SMALL * SMALL).view(SMALL, SMALL)
    conditional = joint.sum(2) / joint.sum((1, 2))[:, None]
    for t1 in range(SMALL):
        if pairs[t1].sum() >= 200:
            assert chi_square_p_value(pairs[t1], conditional[t1]) > ALPHA / SMALL


def test_a_wrong_residual_fails_the_tree_test(tiny_draft, monkeypatch):
    monkeypatch.setattr(rejection, "residual_weights", lambda target, draft, *masses: target)
    shape, settings = TREE_CASES["d3-k3-8"]
    _, accepted, table, processors = _sampled_rows(tiny_draft, shape, settings)
    first = torch.bincount(accepted.tokens[torch.arange(ROWS), accepted.width - accepted.counts], minlength=SMALL)
    assert chi_square_p_value(first, _exact_joint(table, processors).sum((1, 2))) < ALPHA


def test_sampled_tree_structure(tiny_draft):
    tree, _, _, _ = _sampled_rows(tiny_draft, (3, 3, 8), {}, rows=4)
    assert tree.draft_probs.shape[-1] == SMALL
    assert torch.allclose(tree.draft_probs.sum(-1), torch.ones(()))
    expanded = tree.draft_probs_index >= 0
    assert bool(expanded[:, 0].all())
    for b in range(4):
        parents, tokens = tree.parents[b], tree.tokens[b]
        for node in range(1, tree.num_nodes):
            parent = int(parents[node])
            assert bool(expanded[b, parent])  # every parent was expanded: its children were drawn from its q
            q = tree.draft_probs[b, tree.draft_probs_index[b, parent]]
            step = tree.scores[b, node] - tree.scores[b, parent]
            assert torch.allclose(step, q[tokens[node]].log(), atol=1e-5)
        for parent in range(tree.num_nodes):  # siblings are distinct draws
            siblings = tokens[parents == parent]
            assert siblings.unique().numel() == siblings.numel()
