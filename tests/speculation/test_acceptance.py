import pytest
import torch
from transformers import LogitsProcessorList, TopKLogitsWarper

from transformers_poss.speculation.stats import AcceptanceStats
from transformers_poss.speculation.acceptance import (
    accept_tree,
    greedy_accept,
    rejection_sample_children,
    sequential_accept,
)
from tree_testing import one_thread  # noqa: F401 - autouse fixture
from tree_testing import broken_rejection, chi_square_p_value, random_tree, tree_from_parents

VOCAB = 16


def _planted_logits(tree, choices: dict[int, int], generator):
    """Random logits whose argmax at node ``i`` is ``choices[i]``."""
    logits = torch.randn(tree.num_nodes, VOCAB, generator=generator)
    for node, token in choices.items():
        logits[node, token] = logits[node].max() + 1.0
    return logits


def test_greedy_accepts_longest_matching_path_and_bonus():
    #        0(root=5)
    #   1(3)        2(7)
    #   3(1) 4(2)   5(9)
    #             6(4)  (child of 4)
    tree = tree_from_parents([5, 3, 7, 1, 2, 9, 4], [-1, 0, 0, 1, 1, 2, 4])
    gen = torch.Generator().manual_seed(0)
    logits = _planted_logits(tree, {0: 3, 1: 2, 4: 4, 6: 11}, gen)
    result = greedy_accept(tree, logits)
    assert result.path.tolist() == [0, 1, 4, 6]
    assert result.tokens.tolist() == [3, 2, 4, 11]  # three draft tokens, then the bonus
    assert result.num_accepted == 3 and not result.proposed_next
    torch.testing.assert_close(result.scores, logits[[0, 1, 4, 6]])

    logits = _planted_logits(tree, {0: 7, 2: 8}, gen)  # node 2 matches, none of its children does
    result = greedy_accept(tree, logits)
    assert result.path.tolist() == [0, 2] and result.tokens.tolist() == [7, 8] and result.proposed_next

    logits = _planted_logits(tree, {0: 12}, gen)  # nothing matches: only the bonus token
    result = greedy_accept(tree, logits)
    assert result.path.tolist() == [0] and result.tokens.tolist() == [12] and result.num_accepted == 0


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_greedy_equals_walk_over_depths(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(1, num_nodes=20, max_depth=6, vocab_size=VOCAB, generator=gen)
    choices = {}
    for node in range(tree.num_nodes):
        children = (tree.parents == node).nonzero().squeeze(-1)
        if children.numel() and float(torch.rand(1, generator=gen)) < 0.8:
            choices[node] = int(tree.tokens[children[int(torch.randint(children.numel(), (1,), generator=gen))]])
    logits = _planted_logits(tree, choices, gen)
    fast = greedy_accept(tree, logits)
    walk = sequential_accept(tree, logits, torch.tensor([[1]]), LogitsProcessorList(), do_sample=False)
    assert fast.tokens.tolist() == walk.tokens.tolist()
    assert fast.path.tolist() == walk.path.tolist() or len(set(tree.tokens.tolist())) < tree.num_nodes
    torch.testing.assert_close(fast.scores, walk.scores)


def test_processors_see_each_nodes_own_prefix():
    """A processor banning tokens already in the sequence changes the choice at depth 2 only via the depth-1 token."""
    seen = []

    def no_repeat(input_ids, scores):
        seen.append(input_ids[0].tolist())
        return scores.index_fill(-1, input_ids[0], float("-inf"))

    tree = tree_from_parents([5, 3, 4, 6], [-1, 0, 1, 1])
    logits = torch.zeros(4, VOCAB)
    logits[0, 3] = 5.0  # root -> 3 (accepted)
    logits[1, 3] = 9.0  # after 3 the raw argmax is 3 again, banned: next best is 6 (a child)
    logits[1, 6] = 8.0
    logits[3, 10] = 1.0  # after 6: bonus 10
    result = accept_tree(tree, logits, torch.tensor([[9, 5]]), LogitsProcessorList([no_repeat]))
    assert result.tokens.tolist() == [3, 6, 10]
    assert result.path.tolist() == [0, 1, 3]
    assert seen == [[9, 5], [9, 5, 3], [9, 5, 3, 6]]
    assert torch.isinf(result.scores[1, 3])  # scores are the processed ones


def test_sampling_with_top1_is_greedy():
    gen = torch.Generator().manual_seed(3)
    tree = random_tree(1, num_nodes=15, max_depth=5, vocab_size=VOCAB, generator=gen)
    logits = _planted_logits(tree, {0: int(tree.tokens[1])}, gen)
    top1 = LogitsProcessorList([TopKLogitsWarper(top_k=1)])
    sampled = accept_tree(tree, logits, torch.tensor([[1]]), top1, do_sample=True)
    assert sampled.tokens.tolist() == greedy_accept(tree, logits).tokens.tolist()


def _empirical(rule, probs, children, draws):
    counts = torch.zeros(probs.shape[0])
    child_hits = torch.zeros(len(children))
    for _ in range(draws):
        choice, token = rule(probs, children)
        counts[token] += 1
        if choice >= 0:
            assert int(children[choice]) == token
            child_hits[choice] += 1
    return counts, child_hits


def test_rejection_sampling_reproduces_the_target_distribution():
    """Pearson test at a 1e-3 false-alarm rate (fixed seed); the broken rule must fail the same test."""
    probs = torch.tensor([0.30, 0.05, 0.25, 0.02, 0.18, 0.10, 0.06, 0.04])
    children = torch.tensor([2, 0, 2, 4])  # includes a repeated child token
    torch.manual_seed(0)
    counts, child_hits = _empirical(rejection_sample_children, probs, children, 3000)
    assert chi_square_p_value(counts, probs) > 1e-3
    assert child_hits[2] == 0  # the repeat is never accepted a second time
    torch.manual_seed(0)
    broken, _ = _empirical(broken_rejection, probs, children, 3000)
    assert chi_square_p_value(broken, probs) < 1e-3


def test_residual_sampling_when_children_have_all_the_mass():
    probs = torch.tensor([0.0, 0.7, 0.3, 0.0])
    torch.manual_seed(0)
    for _ in range(50):
        choice, token = rejection_sample_children(probs, torch.tensor([1, 2]))
        assert choice >= 0 and token in (1, 2)
    choice, token = rejection_sample_children(probs, torch.tensor([], dtype=torch.long))
    assert choice == -1 and token in (1, 2)


def test_acceptance_stats():
    stats = AcceptanceStats()
    stats.record(2, proposed_next=True)  # positions 1, 2 accepted, 3 rejected
    stats.record(0, proposed_next=True)  # position 1 rejected
    stats.record(3, proposed_next=False)  # positions 1-3 accepted, leaf reached
    assert stats.accepted_lengths == [3, 1, 4]
    assert stats.accepted_draft_tokens == [2, 0, 3]
    assert stats.mean_acceptance_length == pytest.approx(8 / 3)
    assert stats.position_proposed == [3, 2, 2]
    assert stats.position_acceptance == pytest.approx([2 / 3, 1.0, 0.5])
    stats.add_time("drafting", 0.5)
    merged = stats.merge(AcceptanceStats(accepted_lengths=[1], position_accepted=[0], position_proposed=[1]))
    assert merged.accepted_lengths == [3, 1, 4, 1] and merged.position_proposed == [4, 2, 2]
    assert merged.timings == {"drafting": 0.5}
    assert AcceptanceStats().mean_acceptance_length == 0.0
