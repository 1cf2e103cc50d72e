"""The automatic budget of sampled trees: per-level, per-slot acceptance counts and the shape they choose."""

import torch

from transformers_poss.generation.cost_profile import CostProfile
from transformers_poss.generation.sampled_budget import SampledTreeBudget, SlotRates
from transformers_poss.speculation.sampled_drafter import level_sizes
from transformers_poss.speculation.tree import DraftTree, ancestor_mask_from_parents

PROFILE = CostProfile(key="k", verify_seconds={1: 1.0, 4: 1.1, 16: 1.4, 64: 3.0}, draft_context_seconds=0.05,
                      draft_step_seconds=0.05)  # fmt: skip


def tree_of(parents: list[int]) -> DraftTree:
    """Root with children 1, 2, 3 (draw order); node 2 with children 4, 5: ``parents = [-1, 0, 0, 0, 2, 2]``."""
    parents_t = torch.tensor(parents)
    depths = torch.zeros(len(parents), dtype=torch.long)
    for i, p in enumerate(parents[1:], start=1):
        depths[i] = depths[p] + 1
    return DraftTree(torch.arange(len(parents)), parents_t, depths, ancestor_mask_from_parents(parents_t))


def test_slot_counts_follow_the_draw_order_along_the_accepted_path():
    tree = tree_of([-1, 0, 0, 0, 2, 2])
    rates = SlotRates(depth=3, top_k=3)
    rates.observe(tree, torch.tensor([0, 2, 5]))  # second child of the root, then the second child of node 2
    assert rates.tried.tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0]]
    assert rates.accepted.tolist() == [[0, 1, 0], [0, 1, 0], [0, 0, 0]]
    rates.observe(tree, torch.tensor([0]))  # every child of the root tried and rejected
    assert rates.tried[0].tolist() == [2, 2, 1] and rates.accepted[0].tolist() == [0, 1, 0]
    rates.observe(tree, torch.tensor([0, 2]))  # node 2 reached, both its children rejected
    assert rates.tried[1].tolist() == [2, 2, 0] and rates.accepted[1].tolist() == [0, 1, 0]
    a = rates.rates()
    assert a.shape == (3, 3) and bool(((a > 0) & (a < 1)).all())
    go_on = rates.continue_rates()
    assert go_on[:, 0].eq(0).all() and bool((go_on[:, 1:].diff(dim=1) >= 0).all())  # more children, more chance


def test_every_candidate_shape_is_a_sampled_tree_of_that_size():
    budget = SampledTreeBudget(PROFILE, depth=4, max_nodes=20, top_k=3)
    assert budget.shapes and all(sum(level_sizes(d, 3, n)[:d]) == n - 1 for d, n in budget.shapes)
    assert {d for d, _ in budget.shapes} == {1, 2, 3, 4}


def test_the_shape_grows_with_the_observed_acceptance():
    low = SampledTreeBudget(PROFILE, depth=4, max_nodes=20, top_k=3)
    for _ in range(50):
        low.observe_tree(tree_of([-1, 0, 0, 0]), torch.tensor([0]))  # three children, none ever accepted
    high = SampledTreeBudget(PROFILE, depth=4, max_nodes=20, top_k=3)
    for _ in range(50):
        high.observe_tree(tree_of([-1, 0, 1, 2, 3]), torch.tensor([0, 1, 2, 3, 4]))  # a first child always accepted
    low_depth, low_nodes = low.choose_shape()
    high_depth, high_nodes = high.choose_shape()
    assert (low_depth, low_nodes) == (1, 2)
    assert high_depth == 4 and high_nodes > low_nodes
    assert high.chosen_depth == high.next_depth == 4
