"""Context candidates in generate: the draft's tree and continuations copied from the context, verified as one tree.

Greedy output stays identical to plain decoding (B = 1, fixed and automatic budget, and batches); sampling keeps the
target distribution when copied tokens, some of them equal to drafted children, are among a node's children.
"""

import pytest
import torch
from transformers import LogitsProcessorList

from test_generation import (  # noqa: F401 - sampling_target is a fixture
    ALPHA,
    RUNS,
    SAMPLING_CASES,
    VOCAB,
    exact_joint,
    make_draft,
    sample_counts,
    sampling_p_values,
    sampling_target,
    use_proposer,
)
from test_batched_generation import PAD, assert_rows_identical, left_pad
from transformers_poss.generation import PosSCandidateGenerator
from transformers_poss.speculation.trie import CONTEXT_SOURCE, DRAFT_SOURCE
from tree_testing import TargetTopKProposer, one_thread, tiny_llama_target  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def target():
    return tiny_llama_target()


def copying_prompts(target, count=3, seed=7, vocab=VOCAB):
    """Prompts that end by repeating their own start, followed by the target's greedy continuation of that start:
    the continuation can be copied from the context."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        start = torch.randint(3, vocab, (1, 5), generator=gen)
        text = target.generate(start, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
        prompts.append(torch.cat([text, torch.randint(3, vocab, (1, 3), generator=gen), start], dim=1))
    return prompts


def record_trees(monkeypatch):
    trees = []
    original = PosSCandidateGenerator.get_candidates

    def recording(self, *args, **kwargs):
        tree, logits = original(self, *args, **kwargs)
        trees.append(tree)
        return tree, logits

    monkeypatch.setattr(PosSCandidateGenerator, "get_candidates", recording)
    return trees


def assert_siblings_distinct(tree):
    for node in range(tree.num_nodes):
        children = tree.tokens[tree.parents == node].tolist()
        assert len(children) == len(set(children))


@pytest.mark.parametrize("total", [6, 16])
def test_greedy_identical_and_copies_accepted(monkeypatch, target, total):
    draft = make_draft(target, depth=3, top_k=3, total=total)
    draft.generation_config.tree_context_candidates = 6
    trees = record_trees(monkeypatch)
    copied = 0
    other = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))  # nothing to copy
    for prompt in copying_prompts(target) + [other]:
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
        out = target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False, pad_token_id=PAD,
                              return_dict_in_generate=True)  # fmt: skip
        assert out.sequences.tolist() == plain.tolist()
        stats = out.acceptance
        assert stats.source_round_total == stats.num_rounds
        copied += stats.source_tokens.get("context", 0)
    assert copied > 0  # the copying prompts did use the context's continuations
    assert all(tree.num_nodes <= total for tree in trees)
    for tree in trees:
        assert_siblings_distinct(tree)
    assert any(bool(((tree.sources & CONTEXT_SOURCE) > 0).any()) for tree in trees)


def test_on_by_default_and_off_for_the_paper_setting(monkeypatch, target):
    draft = make_draft(target)
    trees = record_trees(monkeypatch)
    prompt = copying_prompts(target, 1)[0]
    plain = target.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    draft.generation_config.tree_context_candidates = None  # unset: on
    out = target.generate(prompt, assistant_model=draft, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                          return_dict_in_generate=True)  # fmt: skip
    assert out.sequences.tolist() == plain.tolist()
    assert all(tree.sources is not None for tree in trees)
    assert any(bool(((tree.sources & CONTEXT_SOURCE) > 0).any()) for tree in trees)  # copies were verified
    trees.clear()
    draft.generation_config.tree_context_candidates = False  # the paper's trees
    out = target.generate(prompt, assistant_model=draft, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                          return_dict_in_generate=True)  # fmt: skip
    assert out.sequences.tolist() == plain.tolist()
    assert all(tree.sources is None for tree in trees) and out.acceptance.source_tokens == {}


def test_greedy_identical_with_the_automatic_budget(monkeypatch, target):
    from test_budget import _profile
    from transformers_poss.generation import budget as budget_module

    cheap = _profile({1: 1.0, 64: 1.2}, draft=0.05)  # a machine where trees pay: speculation goes on
    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: cheap)
    # decisions from that profile alone (plain probe rounds would measure the tiny target, where nothing pays)
    monkeypatch.setattr(budget_module.TreeBudget, "plain_probe_due", lambda self: False)
    draft = make_draft(target, depth=3, top_k=3)
    draft.generation_config.tree_total_tokens = "auto"
    draft.generation_config.tree_max_total_tokens = 12
    draft.generation_config.tree_context_candidates = True
    trees = record_trees(monkeypatch)
    starts = torch.randint(3, VOCAB, (2, 1, 5), generator=torch.Generator().manual_seed(3))
    paid = []
    for start in starts:  # the tiny target's greedy text soon repeats itself (the second one at once)
        prompt = target.generate(start, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
        out = target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False, pad_token_id=PAD,
                              return_dict_in_generate=True)  # fmt: skip
        assert out.sequences.tolist() == plain.tolist()
        paid.append(not out.acceptance.fell_back_to_plain and out.acceptance.source_tokens["context"] > 0)
    assert any(paid)  # where copying pays, the budget keeps speculating with copied nodes
    assert all(tree.num_nodes <= 12 for tree in trees)


def test_batched_rows_identical(target):
    draft = make_draft(target, depth=3, top_k=3, total=16)
    draft.generation_config.tree_context_candidates = 6
    prompts = copying_prompts(target, 2, seed=11) + [torch.randint(3, VOCAB, (1, 4))]
    assert_rows_identical(target, draft, prompts, max_new_tokens=20)
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=20, do_sample=False,
                          pad_token_id=PAD, return_dict_in_generate=True)  # fmt: skip
    stats = out.acceptance
    assert stats.source_tokens.get("context", 0) > 0 and stats.source_round_total == stats.num_rounds


@pytest.mark.parametrize("case, proposer", [("plain", "target-top-k"), ("temperature-top-p", "draft")])
def test_sampling_keeps_the_target_distribution_with_copied_candidates(monkeypatch, sampling_target, case, proposer):
    """Copied continuations of the target's own likely text join the children (merged where they repeat a drafted
    child); the sampled tokens must still follow the target's distribution exactly."""
    target = sampling_target
    start = torch.tensor([[1, 5, 2, 7]])
    text = target.generate(start, max_new_tokens=6, do_sample=False)
    prompt = torch.cat([text, torch.tensor([[3]]), start], dim=1)  # the context continues like `text`
    draft = make_draft(target, depth=2, top_k=3, total=8)
    draft.generation_config.tree_context_candidates = 3
    if proposer == "target-top-k":
        use_proposer(monkeypatch, lambda gen: TargetTopKProposer(target, prompt))
    trees = record_trees(monkeypatch)
    kwargs, processors = SAMPLING_CASES[case]
    torch.manual_seed(0)
    counts, lengths = sample_counts(target, draft, prompt, RUNS, **kwargs)
    assert lengths.count(3) > 0  # depth-2 acceptances happened
    both, copied_only = DRAFT_SOURCE | CONTEXT_SOURCE, CONTEXT_SOURCE
    kinds = [t.sources & (DRAFT_SOURCE | CONTEXT_SOURCE) for t in trees]
    assert any(bool((k == both).any()) for k in kinds)  # copies equal to drafted children were merged into one node
    assert any(bool((k == copied_only).any()) for k in kinds)  # and copies the draft did not propose were verified
    for tree in trees[:50]:
        assert_siblings_distinct(tree)
    joint = exact_joint(target, prompt, LogitsProcessorList(processors))
    assert min(sampling_p_values(counts, joint)) > ALPHA
