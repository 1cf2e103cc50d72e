"""Chains (tree_top_k=1): drafted as one path, verified on the plain causal path, lossless; replayed by `poss tune`."""

import contextlib
import functools

import pytest
import torch
from transformers import LogitsProcessorList

from transformers_poss import use_exact_attention
from transformers_poss.generation import loop, target_forward
from transformers_poss.generation.budget import (CostProfile, RoundRecord, best_children, chain_nodes, simulate_shape,
                                                truncated_accepted)
from transformers_poss.speculation.drafter import PosSProposer
from transformers_poss.speculation.tree import BatchedTree, DraftTree, is_chain
from test_batched_generation import assert_rows_identical, left_pad, row_prompts, use_row_proposers
from test_generation import (  # noqa: F401 - sampling_target is a fixture
    SMALL_VOCAB,
    assert_same,
    exact_joint,
    make_draft,
    prompts,
    sample_counts,
    sampling_p_values,
    sampling_target,
    use_proposer,
)
from tree_testing import (
    OracleProposer,
    TargetTopKProposer,
    one_thread,  # noqa: F401 - autouse fixture
    tiny_gemma3_target,
    tiny_llama_target,
    train_draft_briefly,
    tree_from_parents,
)


def chain_oracle(target, prompt, depth=5, corrupt=0.2, **kwargs):
    """The target's own continuation as a chain (no siblings), tokens corrupted with probability ``corrupt``."""
    return OracleProposer(target, prompt, depth=depth, siblings=0, corrupt=corrupt, **kwargs)


@contextlib.contextmanager
def spy_forward(target):
    """Record the ``attention_mask`` of every verification forward inside the block (all logits and the features:
    not the prefill, nor the forwards of a scripted proposer's own ``generate``)."""
    masks = []
    forward = target.forward

    @functools.wraps(forward)
    def spy(*args, **kwargs):
        if kwargs.get("logits_to_keep") == 0 and kwargs.get("output_hidden_states"):
            masks.append(kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    target.forward = spy
    try:
        yield masks
    finally:
        del target.forward


def speculate(target, draft, prompt, **kwargs):
    """Speculative generate (checked against plain generate) and the masks of its verification forwards."""
    with spy_forward(target) as masks:
        out = target.generate(prompt, assistant_model=draft, return_dict_in_generate=True, **kwargs)
    expected = target.generate(prompt, **kwargs)
    assert out.sequences.tolist() == expected.tolist()
    return out, masks


def spy_trees(monkeypatch):
    """Record every tree the single-row loop verifies (after its cut to the remaining token budget)."""
    trees = []
    verify = loop.verify_tree

    def recording(model, tree, *args, **kwargs):
        trees.append(tree)
        return verify(model, tree, *args, **kwargs)

    monkeypatch.setattr(loop, "verify_tree", recording)
    return trees


def is_4d(mask) -> bool:
    return isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() == 4)


# ---------------------------------------------------------------- chain detection


def test_chain_detection():
    assert tree_from_parents([5, 6, 7, 8], [-1, 0, 1, 2]).is_chain
    assert DraftTree.root_only(torch.tensor(3)).is_chain
    assert not tree_from_parents([5, 6, 7, 8], [-1, 0, 0, 2]).is_chain  # two children of the root
    assert not tree_from_parents([5, 6, 7], [-1, 0, 0]).is_chain
    assert is_chain(torch.tensor([[-1, 0, 1], [-1, 0, 1]])) and not is_chain(torch.tensor([[-1, 0, 1], [-1, 0, 0]]))
    chain = tree_from_parents([5, 6, 7], [-1, 0, 1])
    assert BatchedTree.pack([chain, chain]).is_chain
    assert not BatchedTree.pack([chain, tree_from_parents([5, 6], [-1, 0])]).is_chain  # padding node is a sibling


def test_top_k_1_proposer_drafts_a_chain_of_the_depth():
    target = tiny_llama_target()
    draft = make_draft(target, depth=5, top_k=1, total=60)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = target.model(ids).last_hidden_state
    tree = PosSProposer(draft, depth=5, top_k=1, total_tokens=60).propose(ids, features)
    assert tree.num_nodes == 6 and tree.is_chain and tree.depths.tolist() == list(range(6))
    assert bool((tree.scores[1:] <= tree.scores[:-1]).all())  # cumulative log-probabilities fall along the chain
    short = PosSProposer(draft, depth=5, top_k=1, total_tokens=3).propose(ids, features)
    assert short.is_chain and short.tokens.tolist() == tree.tokens[:3].tolist()


# ---------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_chain_identical_with_random_draft(monkeypatch, make):
    target = make()
    trees = spy_trees(monkeypatch)
    draft = make_draft(target, depth=5, top_k=1, total=60)
    for prompt in prompts(2):
        assert_same(target, draft, prompt, max_new_tokens=20, do_sample=False)
    assert trees and all(t.is_chain for t in trees) and max(t.num_nodes for t in trees) == 6


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_chain_identical_with_trained_draft(monkeypatch, make):
    """Long accepted runs across the sliding window (4 tokens on Gemma 3) through the causal path."""
    target = make()
    draft = make_draft(target, depth=5, top_k=1, total=6)
    train_draft_briefly(target, draft, prompts(3), steps=120)
    trees = spy_trees(monkeypatch)
    longest = 0
    for prompt in prompts(3):
        out = assert_same(target, draft, prompt, max_new_tokens=32, do_sample=False)
        longest = max(longest, max(out.acceptance.accepted_lengths))
    assert longest >= 4
    assert all(t.is_chain for t in trees)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "poss_exact"])
@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_chain_identical_with_scripted_chains(monkeypatch, make, attn):
    target = make(attn="sdpa" if attn == "poss_exact" else attn)
    if attn == "poss_exact":
        use_exact_attention(target)
    draft = make_draft(target, depth=6, top_k=1, total=7)
    for prompt in prompts(2, length=9):
        use_proposer(monkeypatch, lambda gen, p=prompt: chain_oracle(target, p, depth=6, corrupt=0.15))
        out = assert_same(target, draft, prompt, max_new_tokens=30, do_sample=False)
        assert max(out.acceptance.accepted_lengths) >= 5


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_chain_identical_with_left_padding(monkeypatch, make):
    target = make()
    prompt = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompts(1)[0]], dim=-1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], dim=-1)
    use_proposer(monkeypatch, lambda gen: chain_oracle(target, prompt, depth=5, corrupt=0.1, padding=3))
    draft = make_draft(target, depth=5, top_k=1, total=6)
    out, verify_masks = speculate(target, draft, prompt, attention_mask=mask, max_new_tokens=24, do_sample=False)
    assert max(out.acceptance.accepted_lengths) >= 4
    # every verification: the 2D context mask (padding kept) + ones for the chain, never a 4D mask
    length = prompt.shape[1]
    for m, accepted in zip(verify_masks, out.acceptance.accepted_lengths):
        assert m.dim() == 2 and m.shape[0] == 1 and m[0, :3].sum() == 0 and bool(m[0, 3:].bool().all())
        assert m.shape[1] > length
        length += accepted


# ---------------------------------------------------------------- which path is used


@pytest.mark.parametrize("attn", ["sdpa", "poss_exact"])
@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_chains_take_the_causal_path_trees_the_tree_mask(monkeypatch, make, attn):
    target = make()
    if attn == "poss_exact":
        use_exact_attention(target)
    prompt = prompts(1, length=9)[0]
    kwargs = dict(max_new_tokens=12, do_sample=False)
    trees = spy_trees(monkeypatch)
    _, chain_masks = speculate(target, make_draft(target, depth=4, top_k=1, total=5), prompt, **kwargs)
    assert len(trees) == len(chain_masks) and max(t.num_nodes for t in trees) == 5
    assert all(m is None for m in chain_masks)  # no padding: transformers builds its own causal mask
    trees.clear()
    _, tree_masks = speculate(target, make_draft(target, depth=4, top_k=3, total=10), prompt, **kwargs)
    assert len(trees) == len(tree_masks) and sum(not t.is_chain for t in trees) >= 3
    for tree, mask in zip(trees, tree_masks):  # a round cut to its root by max_new_tokens is a chain too
        assert is_4d(mask) if not tree.is_chain else mask is None


def test_root_only_tree_is_a_plain_step():
    """A depth-limited last round (one token left) verifies the root alone: also the causal path."""
    target = tiny_llama_target()
    prompt = prompts(1)[0]
    _, masks = speculate(target, make_draft(target, depth=4, top_k=3, total=10), prompt, max_new_tokens=2,
                         do_sample=False)
    assert masks == [None]  # the only round: budget 1 token -> root only


# ---------------------------------------------------------------- batched


def _batched_masks(monkeypatch, target, rows, depth):
    use_row_proposers(monkeypatch, lambda: [chain_oracle(target, p, depth=depth, corrupt=0.2, seed=i)
                                            for i, p in enumerate(rows)])
    draft = make_draft(target, depth=depth, top_k=1, total=depth + 1)
    with spy_forward(target) as masks:
        ids, mask = left_pad(rows)
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, pad_token_id=0,
                              max_new_tokens=24)  # fmt: skip
    use_row_proposers(monkeypatch, lambda: [chain_oracle(target, p, depth=depth, corrupt=0.2, seed=i)
                                            for i, p in enumerate(rows)])
    checked = assert_rows_identical(target, draft, rows, max_new_tokens=24)
    assert out.tolist() == checked.sequences.tolist()
    assert max(checked.acceptance.accepted_lengths) >= 4
    return masks


def test_batched_chains_identical_and_causal_on_full_attention(monkeypatch):
    masks = _batched_masks(monkeypatch, tiny_llama_target(), row_prompts([10, 5, 7]), depth=4)
    assert masks and all(isinstance(m, torch.Tensor) and m.dim() == 2 for m in masks)


def test_batched_chains_keep_the_tree_mask_with_sliding_windows(monkeypatch):
    """Gemma 3 in a batch: the cache has holes, windows are applied by position, so chains keep the 4D masks."""
    masks = _batched_masks(monkeypatch, tiny_gemma3_target(), row_prompts([10, 5]), depth=5)
    assert masks and all(is_4d(m) for m in masks)


def test_batched_real_chain_draft_identical():
    target = tiny_llama_target()
    draft = make_draft(target, depth=4, top_k=1, total=16)  # 16 // 3 rows: every row keeps its whole chain
    rows = row_prompts([9, 4, 6])
    train_draft_briefly(target, draft, rows, steps=120)
    with spy_forward(target) as masks:
        out = assert_rows_identical(target, draft, rows, max_new_tokens=20)
    assert max(out.acceptance.accepted_lengths) >= 3
    assert masks and all(isinstance(m, torch.Tensor) and m.dim() == 2 for m in masks)  # the batched proposer: chains


# ---------------------------------------------------------------- sampling


def test_sampling_with_chains_keeps_the_target_distribution(monkeypatch, sampling_target):
    """Chains of the target's top-1 tokens (depth 2): accepted often, rejected often; samples follow the target."""
    target = sampling_target
    prompt = torch.tensor([[1, 5, 2, 7]])
    draft = make_draft(target, depth=2, top_k=1, total=3)
    use_proposer(monkeypatch, lambda gen: TargetTopKProposer(target, prompt, widths=(1, 1)))
    trees = spy_trees(monkeypatch)
    torch.manual_seed(0)
    with spy_forward(target) as masks:
        counts, lengths = sample_counts(target, draft, prompt, 400, temperature=0.8)
    assert lengths.count(3) > 0 and lengths.count(1) > 0
    assert all(t.is_chain for t in trees) and not any(is_4d(m) for m in masks)
    from transformers import TemperatureLogitsWarper

    joint = exact_joint(target, prompt, LogitsProcessorList([TemperatureLogitsWarper(0.8)]))
    assert min(sampling_p_values(counts, joint)) > 1e-3


# ---------------------------------------------------------------- replay of recorded rounds as chains


def _profile(curve, draft=0.0):
    return CostProfile(key="k", verify_seconds=curve, draft_context_seconds=draft, draft_step_seconds=draft)


def _record(path):
    """Root; depth 1: A (node 1, p .5), B (node 2, p .45); A's children: node 3 (.1), node 4 (.2, the better one but
    later in node order); B's child: node 5 (.44, the best depth-2 node, but not on the top-1 path); node 4's child:
    node 6 (.15)."""
    probs = torch.tensor([1.0, 0.5, 0.45, 0.1, 0.2, 0.44, 0.15])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 4])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3])
    return RoundRecord(depths=depths, scores=probs.log(), path=torch.tensor(path), parents=parents)


def test_chain_replay_counts_only_the_top_1_path():
    record = _record([0, 1, 4, 6])
    assert best_children(record.parents, record.scores).tolist() == [1, 4, 5, 7, 6, 7, 7]
    assert chain_nodes(record, 5).tolist() == [1, 4, 6]  # the walk ends where the tree has no child
    assert truncated_accepted(record, depth=3, total_tokens=4, top_k=1) == 3
    assert truncated_accepted(record, depth=2, total_tokens=3, top_k=1) == 2
    assert truncated_accepted(record, depth=3, total_tokens=2, top_k=1) == 1  # a chain of min(depth, total - 1)
    # the accepted path leaves the top-1 path: the chain keeps only the shared prefix, the tree keeps more
    off = _record([0, 1, 3])
    assert truncated_accepted(off, depth=3, total_tokens=4, top_k=1) == 1
    assert truncated_accepted(off, depth=3, total_tokens=7) == 2
    # the best depth-2 node overall (node 5, under B) is not on the chain
    other = _record([0, 2, 5])
    assert truncated_accepted(other, depth=3, total_tokens=4, top_k=1) == 0
    assert truncated_accepted(other, depth=3, total_tokens=7) == 2


def test_chain_replay_breaks_ties_by_node_order_and_needs_parents():
    record = RoundRecord(depths=torch.tensor([0, 1, 1, 2]), scores=torch.tensor([0.0, -1.0, -1.0, -2.0]),
                         path=torch.tensor([0, 2, 3]), parents=torch.tensor([-1, 0, 0, 2]))
    assert chain_nodes(record, 3).tolist() == [1]  # tie between nodes 1 and 2: the first; node 1 has no child
    assert truncated_accepted(record, depth=3, total_tokens=4, top_k=1) == 0
    with pytest.raises(ValueError, match="parents"):
        truncated_accepted(RoundRecord(record.depths, record.scores, record.path), 3, 4, top_k=1)


def test_simulate_chain_shape():
    records = [_record([0, 1, 4, 6]), _record([0, 2, 5])]
    profile = _profile({1: 1.0, 3: 2.0, 4: 3.0, 7: 4.0})
    chain = simulate_shape(records, profile, depth=3, total_tokens=60, top_k=1)
    assert chain["kind"] == "chain" and chain["top_k"] == 1 and chain["total_tokens"] == 4 and chain["depth"] == 3
    assert chain["mean_acceptance_length"] == (4 + 1) / 2
    assert abs(chain["predicted_speedup"] - 5 / (2 * 3.0)) < 1e-9
    tree = simulate_shape(records, profile, depth=3, total_tokens=7, top_k=4)
    assert tree["kind"] == "tree" and tree["mean_acceptance_length"] == (4 + 3) / 2


def test_chain_replay_is_what_a_top_1_proposer_drafts():
    """The top-1 path of a recorded big tree has the tokens a top-k 1 proposer drafts from the same context."""
    target = tiny_llama_target()
    draft = make_draft(target)
    train_draft_briefly(target, draft, prompts(2), steps=60)
    for prompt in prompts(3, seed=9):
        with torch.no_grad():
            features = target.model(prompt).last_hidden_state
        big = PosSProposer(draft, depth=4, top_k=4, total_tokens=200).propose(prompt, features)
        chain = PosSProposer(draft, depth=4, top_k=1, total_tokens=5).propose(prompt, features)
        record = RoundRecord(big.depths, big.scores, torch.tensor([0]), big.parents)
        nodes = chain_nodes(record, 4)
        assert nodes.shape[0] == 4  # with every node kept, each top-1 node was on the frontier
        assert big.tokens[nodes].tolist() == chain.tokens[1:].tolist()
        torch.testing.assert_close(big.scores[nodes], chain.scores[1:], atol=1e-5, rtol=1e-5)


def test_recorded_rounds_carry_parents_for_chain_replay():
    target = tiny_llama_target()
    draft = make_draft(target, depth=4, top_k=3, total=12)
    draft.generation_config.tree_record_rounds = True
    prompt = prompts(1)[0]
    out = assert_same(target, draft, prompt, max_new_tokens=12, do_sample=False)
    rounds = out.acceptance.rounds
    assert rounds and all(r.parents is not None and r.parents.shape == r.depths.shape for r in rounds)
    result = simulate_shape(rounds, _profile({1: 1.0, 64: 1.0}), depth=4, total_tokens=5, top_k=1)
    assert result["kind"] == "chain" and result["mean_acceptance_length"] >= 1.0


def test_chain_attention_mask():
    assert hasattr(loop, "verify_tree")  # the name spy_trees replaces
    assert target_forward.chain_attention_mask(3, None) is None
    mask = target_forward.chain_attention_mask(2, torch.tensor([False, True, True]))
    assert mask.tolist() == [[0, 1, 1, 1, 1]]


# ---------------------------------------------------------------- poss tune and poss bench --sweep


def test_tune_candidates_include_chains_and_a_chain_can_win():
    from transformers_poss.cli.tune import DEPTHS, candidate_shapes

    records = [_record([0, 1, 4, 6]), _record([0, 1, 4, 6]), _record([0, 2, 5])]
    steep = _profile({1: 1.0, 2: 1.2, 4: 1.4, 64: 64.0}, draft=0.01)  # every extra node costs: a chain is best
    chain_profile = _profile(steep.verify_seconds, draft=0.005)
    results = candidate_shapes(records, steep, chain_profile, top_k=4)
    chains = [r for r in results if r["kind"] == "chain"]
    assert sorted(r["depth"] for r in chains) == list(DEPTHS)
    assert all(r["top_k"] == 1 and r["total_tokens"] == r["depth"] + 1 for r in chains)
    assert any(r["kind"] == "tree" and r["top_k"] == 4 for r in results)
    speedups = [r["predicted_speedup"] for r in results]
    assert speedups == sorted(speedups, reverse=True)
    assert results[0]["kind"] == "chain" and results[0]["depth"] == 3
    flat = _profile({1: 1.0, 64: 1.0}, draft=0.01)  # verification free: the wide tree accepts more
    assert candidate_shapes(records, flat, flat, top_k=4)[0]["kind"] == "tree"
    assert {r["kind"] for r in candidate_shapes(records, steep, chain_profile, top_k=1)} == {"chain"}


def test_bench_sweep_adds_one_chain_per_depth(monkeypatch):
    import argparse

    from transformers_poss.cli import bench as bench_cli

    target = tiny_llama_target()
    draft = make_draft(target)
    monkeypatch.setattr(bench_cli, "load_draft", lambda source, model: draft)
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    base = ["--questions", "q.jsonl", "--draft", "poss=somewhere", "--no-prompt-lookup", "--sweep",
            "--sweep-depths", "2,5", "--sweep-total-tokens", "8,16"]
    names = {m.name: m for m in bench_cli.build_methods(parser.parse_args(base), target)}
    assert {"poss[chain d=2]", "poss[chain d=5]", "poss[d=2,n=8]", "poss[d=5,n=16]"} <= set(names)
    assert names["poss[chain d=5]"].info["tree"] == {"depth": 5, "top_k": 1, "total_tokens": 6}
    assert names["poss[chain d=5]"].info["sweep"] and names["poss[chain d=5]"].info["draft"] == "poss"
    without = bench_cli.build_methods(parser.parse_args(base + ["--no-sweep-chains"]), target)
    assert not any("chain" in m.name for m in without) and len(without) == len(names) - 2


def test_tune_measures_the_chosen_chain_as_a_chain(monkeypatch):
    from transformers_poss.cli.tune import measure

    target = tiny_llama_target()
    draft = make_draft(target, depth=4, top_k=4, total=16)
    trees = spy_trees(monkeypatch)
    shape = {"kind": "chain", "depth": 3, "top_k": 1, "total_tokens": 4}
    speedup, tau = measure(target, draft, [(p, torch.ones_like(p)) for p in prompts(2)], 10, shape)
    assert speedup > 0 and tau >= 1.0
    assert trees and all(t.is_chain for t in trees) and max(t.num_nodes for t in trees) == 4
    assert draft.generation_config.tree_top_k == 4  # the draft's own shape is restored


def test_cli_tune_reports_chains(tmp_path, monkeypatch, capsys):
    """`poss tune` end to end on a tiny target: chains among the candidates, the winning kind printed and saved."""
    import importlib.util
    import json

    from helpers import save_tiny_target, tiny_draft, tiny_llama, write_questions

    from transformers_poss import cli

    monkeypatch.setenv("POSS_CACHE", str(tmp_path / "cache"))
    target = tiny_llama(vocab_size=128, hidden_size=32)
    target.generation_config.eos_token_id = None
    folder = save_tiny_target(tmp_path / "tiny_target", target)
    tiny_draft(target).save_pretrained(tmp_path / "draft")
    q = write_questions(tmp_path / "q.jsonl", 1, "x")
    out = tmp_path / "tune.json"
    status = cli.main(["tune", "--target", str(folder), "--draft", str(tmp_path / "draft"), "--questions", q,
                       "--num-prompts", "1", "--max-new-tokens", "6", "--top-k", "3", "--output", str(out), "--save"])
    assert status == 0
    report = json.loads(out.read_text())
    kinds = {c["kind"] for c in report["candidates"]}
    assert kinds == {"chain", "tree"} and report["chain_profile"]["meta"]["top_k"] == 1
    text = capsys.readouterr().out
    assert f"-> a {report['chosen']['kind']} wins" in text and "best chain: depth" in text  # top-8 table may hold no chain
    saved = json.loads((tmp_path / "draft" / "generation_config.json").read_text())
    assert saved["tree_top_k"] == report["chosen"]["top_k"] and saved["tree_depth"] == report["chosen"]["depth"]
    if importlib.util.find_spec("matplotlib"):  # the cost curve and the replayed shapes, next to the report
        assert (tmp_path / "tune.cost_curve.png").read_bytes()[:4] == b"\x89PNG"
        assert f"cost curve plot: {tmp_path / 'tune.cost_curve.png'}" in text
    quiet = tmp_path / "quiet" / "tune.json"
    assert cli.main(["tune", "--target", str(folder), "--draft", str(tmp_path / "draft"), "--questions", q,
                     "--num-prompts", "1", "--max-new-tokens", "4", "--output", str(quiet), "--no-plots"]) == 0
    assert [p.name for p in quiet.parent.iterdir()] == ["tune.json"]


# ---------------------------------------------------------------- real target (slow, marked integration)


@pytest.mark.integration
def test_smollm2_chain_identical_on_mt_bench():
    """The shipped draft as a chain (top-k 1, depth 4) on 4 MT-Bench prompts: identical to plain greedy."""
    from test_generation_real import TRAINED_DRAFT, _chat_ids, _draft, _load, _questions

    target, tokenizer = _load("smollm2-135m-instruct")
    draft = _draft(target, TRAINED_DRAFT)
    draft.generation_config.tree_depth, draft.generation_config.tree_top_k = 4, 1
    draft.generation_config.tree_total_tokens = 5
    for text in _questions(4):
        ids = _chat_ids(tokenizer, text)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
        out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, target.generate(ids, **kwargs))
        assert len(out.acceptance.accepted_lengths) >= 1
