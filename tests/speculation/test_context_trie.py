"""Continuations copied from the context and the trie that merges them with the draft's tree."""

import torch

from transformers_poss.generation.hybrid import (DEFAULT_CONTEXT_TOKENS, ContextCandidates, SourceEstimates,
                                                 context_candidate_tokens,
                                                 drafting_depths, on_path_mask)
from transformers_poss.speculation.context_match import context_continuations, match_continuations, suffix_queries
from transformers_poss.speculation.stats import AcceptanceStats
from transformers_poss.speculation.tree import BatchedTree, batched_ancestor_mask
from transformers_poss.speculation.trie import (CHAIN_START, CONTEXT_SOURCE, DRAFT_SOURCE, graft_chains,
                                                keep_nodes)
from tree_testing import one_thread  # noqa: F401 - autouse fixture
from tree_testing import tree_from_parents

import pytest


def _paths(tree: BatchedTree, row: int = 0) -> list[tuple[int, ...]]:
    """Every valid node's root-to-node tokens (root excluded), one entry per node (so duplicates show)."""
    mask = batched_ancestor_mask(tree.parents)[row]
    out = []
    for i in range(1, tree.num_nodes):
        if not bool(tree.valid[row, i]):
            continue
        ancestors = sorted((j for j in range(1, i + 1) if mask[i, j]), key=lambda j: int(tree.depths[row, j]))
        out.append(tuple(int(tree.tokens[row, j]) for j in ancestors))
    return out


def _batch(tokens, parents, scores=None):
    tree = tree_from_parents(tokens, parents).as_batch()
    if scores is not None:
        tree.scores = torch.tensor([scores], dtype=torch.float)
    return tree


# ---------------------------------------------------------------- matching


def test_longest_then_latest_match_and_no_self_match():
    context = torch.tensor([7, 1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3])
    queries = suffix_queries(context, context[-1:].view(1, 1), torch.zeros(1, dtype=torch.long), 3)
    assert queries.tolist() == [[1, 2, 3]]
    found = match_continuations(context, queries, num_tokens=3, min_ngram=2)
    # "1 2 3" occurs at 1..3 (3 tokens) and "2 3" at 6..7 (2 tokens): the longest wins, not the latest
    assert found.lengths.tolist() == [3] and found.tokens.tolist() == [[4, 9, 2]] and found.valid.all()
    found = match_continuations(context[:-1], torch.tensor([[8, 1, 2]]), num_tokens=2, min_ngram=1)
    assert found.lengths.tolist() == [2] and found.tokens.tolist() == [[3, 4]]  # "8 1 2" ends the context: unused
    # the query at the root is the end of the context itself: that window has no continuation and is never used
    found = match_continuations(torch.tensor([5, 6, 7]), torch.tensor([[5, 6, 7]]), num_tokens=2)
    assert found.lengths.tolist() == [0] and not found.valid.any()


def test_latest_among_equally_long_matches_and_min_ngram():
    context = torch.tensor([1, 2, 5, 1, 2, 6, 3, 1, 2])
    found = match_continuations(context, torch.tensor([[3, 1, 2]]), num_tokens=2, min_ngram=2)
    assert found.lengths.tolist() == [2] and found.tokens.tolist() == [[6, 3]]  # the later "1 2"
    found = match_continuations(context, torch.tensor([[0, 0, 2]]), num_tokens=2, min_ngram=2)
    assert found.lengths.tolist() == [0] and not found.valid.any()  # a 1-token match is below min_ngram
    found = match_continuations(context, torch.tensor([[3, 1, 2]]), num_tokens=4, min_ngram=2)
    assert found.valid.tolist() == [[True, True, True, True]]
    found = match_continuations(torch.tensor([4, 1, 2, 9, 1, 2]), torch.tensor([[0, 1, 2]]), num_tokens=3)
    assert found.tokens[0, :1].tolist() == [9] and found.valid.tolist() == [[True, True, True]]


def test_queries_run_through_the_node_path():
    # root 3 (last context token), node 1 = 4 (depth 1), node 2 = 9 below it (depth 2)
    context = torch.tensor([1, 2, 3, 4, 9, 5, 6, 2, 3])
    tree = tree_from_parents([3, 4, 9], [-1, 0, 1])
    found = context_continuations(context, tree.tokens, tree.depths, tree.tree_mask, num_tokens=2, max_ngram=3,
                                  min_ngram=2)
    assert found.lengths.tolist() == [2, 3, 3]  # "2 3", "2 3 4", "3 4 9"
    assert found.tokens.tolist() == [[4, 9], [9, 5], [5, 6]]


# ---------------------------------------------------------------- the merged trie


def test_shared_prefix_is_verified_once():
    # draft: root 2 -> 3 -> 4, root -> 7
    base = _batch([2, 3, 7, 4], [-1, 0, 0, 1])
    anchors = torch.tensor([[0, 0, 1, 2]])
    chains = torch.tensor([[[3, 4, 5], [3, 4, 6], [4, 5, 0], [8, 0, 0]]])
    valid = torch.tensor([[[True, True, True], [True, True, True], [True, True, False], [True, False, False]]])
    merged = graft_chains(base, anchors, chains, valid)
    paths = _paths(merged.tree)
    assert len(paths) == len(set(paths))  # every path once: shared prefixes are one node
    assert set(paths) == {(3,), (7,), (3, 4), (3, 4, 5), (3, 4, 6), (7, 8)}
    assert merged.tree.num_nodes == 7  # 4 drafted + 5, 6 and 8; "3 4" and "4 5" below node 1 are reused
    tree, sources, step = merged.tree, merged.sources[0].tolist(), merged.chain_step[0].tolist()
    assert sources[:4] == [0, DRAFT_SOURCE | CONTEXT_SOURCE, DRAFT_SOURCE, DRAFT_SOURCE | CONTEXT_SOURCE]
    assert sources[4:] == [CONTEXT_SOURCE] * 3
    assert step[1] == 1 and step[3] == 2  # node "3 4" continues the root's chains
    assert bool((tree.parents[0, 1:] < torch.arange(1, tree.num_nodes)).all())  # parents before children
    assert merged.base_index[0].tolist() == [0, 1, 2, 3, -1, -1, -1]
    for node in range(tree.num_nodes):  # siblings never repeat a token
        children = tree.tokens[0][tree.parents[0] == node].tolist()
        assert len(children) == len(set(children))


def test_graft_rows_independently_and_identical_chains_become_one_node():
    base = BatchedTree.pack([tree_from_parents([2, 3], [-1, 0]), tree_from_parents([5, 6, 7], [-1, 0, 1])])
    chains = torch.tensor([[[9, 9], [9, 9]], [[6, 7], [9, 9]]])
    merged = graft_chains(base, torch.tensor([[0, 0], [0, 2]]), chains, torch.ones(2, 2, 2, dtype=torch.bool))
    assert sorted(_paths(merged.tree, 0)) == [(3,), (9,), (9, 9)]
    assert sorted(_paths(merged.tree, 1)) == [(6,), (6, 7), (6, 7, 9), (6, 7, 9, 9)]
    assert merged.tree.valid[0].sum() == 4 and merged.tree.valid[1].sum() == 5  # roots included


def test_keep_nodes_compacts_and_pads():
    tree = BatchedTree.pack([tree_from_parents([1, 2, 3, 4], [-1, 0, 1, 0]), tree_from_parents([5, 6], [-1, 0])])
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    kept, extra = keep_nodes(tree, keep, torch.arange(4).expand(2, 4))
    assert kept.tokens[0].tolist() == [1, 2, 3] and kept.parents[0].tolist() == [-1, 0, 1]
    assert kept.valid.tolist() == [[True, True, True], [True, True, False]]
    assert extra.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert torch.equal(kept.tree_mask, batched_ancestor_mask(kept.parents))


# ---------------------------------------------------------------- sources: estimates and budget


def test_extend_keeps_the_total_and_ranks_by_source_estimates():
    context = torch.tensor([9, 1, 2, 3, 4, 5, 6, 1, 2])
    draft = _batch([2, 7, 8, 6], [-1, 0, 0, 1], scores=[0.0, -1.0, -1.5, -3.0])
    hybrid = ContextCandidates(num_tokens=4)
    hybrid.estimates.first = [9.0, 10.0]  # copies from the context have paid off in this call
    hybrid.estimates.next = [9.0, 10.0]
    tree = hybrid.extend(draft, [context], max_nodes=5)
    assert tree.num_nodes == 5 and bool(tree.valid.all())
    paths = _paths(tree)
    assert {(3,), (3, 4), (3, 4, 5)} <= set(paths) and len(paths) == len(set(paths))
    assert (7, 6) not in paths  # the weak drafted grandchild gave its node to a copied token
    assert bool((tree.scores[0, 1:] <= tree.scores[0, tree.parents[0, 1:]] + 1e-6).all())  # children never outrank
    # a copying source that does not pay gets no nodes within the total
    hybrid.estimates.first = [0.1, 100.0]
    tree = hybrid.extend(draft, [context], max_nodes=4)
    assert (tree.sources[0] & CONTEXT_SOURCE).sum() == 0 and tree.num_nodes == 4


def test_estimates_learn_from_accepted_paths_and_copies_cost_no_drafting():
    tree = _batch([2, 3, 4, 5], [-1, 0, 1, 1], scores=[0.0, -0.5, -1.0, -2.0])
    tree.sources = torch.tensor([[0, DRAFT_SOURCE | CONTEXT_SOURCE | CHAIN_START, CONTEXT_SOURCE, DRAFT_SOURCE]])
    tree.draft_logprobs = torch.tensor([[0.0, -0.5, 0.0, -1.5]])
    estimates = SourceEstimates(prior_weight=0.0 + 1e-9)
    estimates.observe(tree, on_path_mask(4, torch.tensor([[0, 1, 2]])))
    assert estimates.first_rate == pytest.approx(1.0) and estimates.next_rate == pytest.approx(1.0)
    tried = torch.tensor([-0.5, -1.5]).exp().sum().item()  # draft nodes 1 and 3 were tried, node 1 was accepted
    assert estimates.draft_calibration == pytest.approx(1.0 / tried, rel=1e-4)
    assert drafting_depths(tree)[0].tolist() == [0, 0, 0, 2]  # node 3: drafted below a copied node


def test_setting_values():
    class Config:
        tree_context_candidates = None

    config = Config()
    for value, expected in ((None, DEFAULT_CONTEXT_TOKENS), (False, 0), (0, 0), (True, DEFAULT_CONTEXT_TOKENS), (5, 5)):
        config.tree_context_candidates = value
        assert context_candidate_tokens(config) == expected
        # trees sampled from the draft cannot take copies: unset yields there, an explicit value is kept (and refused
        # by the generation loop)
        assert context_candidate_tokens(config, sampled_trees=True) == (0 if value is None else expected)
    for bad in (-1, 2.5, "yes"):
        config.tree_context_candidates = bad
        with pytest.raises(ValueError, match="tree_context_candidates"):
            context_candidate_tokens(config)


def test_source_statistics_merge():
    stats = AcceptanceStats()
    stats.record_sources([DRAFT_SOURCE, DRAFT_SOURCE | CONTEXT_SOURCE, CONTEXT_SOURCE])
    stats.record_sources([])
    other = AcceptanceStats()
    other.record_sources([CONTEXT_SOURCE | CHAIN_START])
    merged = stats.merge(other)
    assert merged.source_tokens == {"draft": 2, "context": 3}
    assert merged.source_rounds == {"draft": 1, "context": 2} and merged.source_round_total == 3
    assert merged.source_round_share["context"] == pytest.approx(2 / 3)


def test_budget_drafts_nothing_while_copies_win_and_probes_again():
    from transformers_poss.generation.budget import CostProfile, TreeBudget

    profile = CostProfile(key="k", verify_seconds={1: 1.0, 64: 1.0}, draft_context_seconds=0.5,
                          draft_step_seconds=0.5)  # drafting costs half a forward per level
    budget = TreeBudget(profile, depth=3, max_nodes=8, calibrate=False, allow_no_draft=True, probe_every=3)
    scores = torch.tensor([0.0, -0.05, -0.1, -3.0, -3.5])
    needs = torch.tensor([0, 0, 0, 1, 2])  # two copied nodes (no drafting needed), two weak drafted ones
    depths = []
    for _ in range(6):
        keep, _ = budget.choose(scores, needs, drafted_depth=budget.next_depth)
        assert keep.tolist() == [0, 1, 2]  # the copied nodes only
        depths.append(budget.next_depth)
    assert depths == [0, 0, 1, 0, 0, 1]  # nothing drafted, a depth-1 probe every third round
    assert budget.chosen_depth == 0


def test_budget_drafts_again_after_a_round_worth_nothing():
    """A round where neither source offers a node worth verifying keeps the root alone at depth 0; that is no win of
    the copies, so the next round drafts (depth 1), as it would without context candidates."""
    from transformers_poss.generation.budget import CostProfile, TreeBudget

    profile = CostProfile(key="k", verify_seconds={1: 1.0, 64: 2.0}, draft_context_seconds=0.5,
                          draft_step_seconds=0.5)
    budget = TreeBudget(profile, depth=3, max_nodes=8, calibrate=False, allow_no_draft=True, probe_every=3)
    weak = torch.tensor([0.0, -4.0, -5.0])  # two unlikely drafted nodes, no copies
    keep, _ = budget.choose(weak, torch.tensor([0, 1, 2]), drafted_depth=2)
    assert keep.tolist() == [0] and budget.chosen_depth == 0
    assert budget.next_depth == 1
    nothing = torch.tensor([0.0])  # an undrafted round whose context offered nothing either
    budget.choose(nothing, torch.tensor([0]), drafted_depth=0)
    assert budget.next_depth == 1
    copies = torch.tensor([0.0, -0.05, -0.1])  # copied nodes that win at depth 0: the next round drafts nothing
    keep, _ = budget.choose(copies, torch.tensor([0, 0, 0]), drafted_depth=1)
    assert keep.tolist() == [0, 1, 2] and budget.next_depth == 0


def test_unique_rows_matches_torch_unique():
    from transformers_poss.speculation.trie import unique_rows

    generator = torch.Generator().manual_seed(0)
    for width, high in ((1, 3), (5, 4), (19, 50_000)):  # wide rows of large tokens span several packed words
        rows = torch.randint(-1, high, (300, width), generator=generator)
        rows[100:200] = rows[:100]  # duplicates
        expected, expected_inverse = torch.unique(rows, dim=0, return_inverse=True)
        found, inverse = unique_rows(rows)
        assert torch.equal(found, expected) and torch.equal(inverse, expected_inverse)


def test_copied_rates_by_position_and_single_token_matches():
    from transformers_poss.speculation.trie import POSITION_SHIFT, SHORT_MATCH, chain_position

    # a copied chain root -> 1 -> 2 -> 3: its second token is right half the time, its third whenever it is tried
    chain = _batch([9, 1, 2, 3], [-1, 0, 1, 2], scores=[0.0, -1.0, -2.0, -3.0])
    position = [step << POSITION_SHIFT for step in range(4)]  # the node's position in the continuation
    chain.sources = torch.tensor([[0, CONTEXT_SOURCE | CHAIN_START | position[1], CONTEXT_SOURCE | position[2],
                                   CONTEXT_SOURCE | position[3]]])
    chain.draft_logprobs = torch.zeros(1, 4)
    estimates = SourceEstimates()
    for _ in range(8):
        estimates.observe(chain, on_path_mask(4, torch.tensor([[0, 1, 2, 3]])))
        estimates.observe(chain, on_path_mask(4, torch.tensor([[0, 1]])))
        estimates.observe(chain, on_path_mask(4, torch.tensor([[0]])))
    rates = estimates.step_rates()
    assert estimates.first_rate == pytest.approx((0.6 + 16) / 26)
    assert float(rates[1]) == pytest.approx(estimates.first_rate)
    assert float(rates[2]) == pytest.approx((8 + 2 * estimates.next_rate) / 18)  # 8 of 16, toward the pooled rate
    assert rates[3] > rates[2] + 0.3  # each position has its own rate
    assert float(rates[5]) == pytest.approx(estimates.next_rate)  # a position never tried: the pooled rate
    log_estimates = estimates.node_log_estimates(chain, chain.sources, chain.draft_logprobs)[0]
    assert float(log_estimates[3].exp()) == pytest.approx(estimates.first_rate * float(rates[2] * rates[3]), rel=1e-6)

    # the root's continuation after a single matching token is marked and estimated at its own (lower) rate
    hybrid = ContextCandidates(num_tokens=2)
    root_only = _batch([5], [-1], scores=[0.0])
    short = hybrid.merge(root_only, [torch.tensor([5, 6, 7, 8, 5])])  # "5" seen once before: a 1-token match
    long = hybrid.merge(root_only, [torch.tensor([4, 5, 6, 7, 4, 5])])  # "4 5" seen before: a 2-token match
    assert short.tokens[0, 1:].tolist() == [6, 7] and long.tokens[0, 1:].tolist() == [6, 7]
    assert (short.sources[0, 1] & SHORT_MATCH) and not (long.sources[0, 1] & SHORT_MATCH)
    assert chain_position(short.sources)[0].tolist() == [0, 1, 2]
    first = float(hybrid.estimates.node_log_estimates(short, short.sources, short.draft_logprobs)[0, 1].exp())
    assert first == pytest.approx(hybrid.estimates.short_first_rate) and first < hybrid.estimates.first_rate


def test_equally_long_matches_prefer_a_whole_continuation():
    # "1 2" ends at positions 1 (followed by 8 tokens) and 7 (followed by 2 tokens before the query itself)
    context = torch.tensor([1, 2, 5, 6, 7, 8, 1, 2, 1, 2])
    found = match_continuations(context, torch.tensor([[1, 2]]), num_tokens=3, min_ngram=2)
    assert found.tokens.tolist() == [[5, 6, 7]] and found.valid.all()
    found = match_continuations(context, torch.tensor([[1, 2]]), num_tokens=2, min_ngram=2)
    assert found.tokens.tolist() == [[1, 2]]  # both are whole: the latest
