"""``tree_sampling="draft_probabilities"`` through ``generate``: the target distribution for B = 1 and batches, greedy
output unchanged, the setting saved and loaded, and clear errors."""

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from transformers_poss import PosSDraftModel
from transformers_poss.speculation import rejection
from test_batched_generation import PAD, left_pad, row_prompts
from test_generation import (  # noqa: F401 - sampling_target is a fixture
    SMALL_VOCAB,
    exact_joint,
    make_draft,
    sample_counts,
    sampling_p_values,
    sampling_target,
)
from tree_testing import one_thread, tiny_llama_target  # noqa: F401 - autouse fixture

MODE = "draft_probabilities"
ALPHA = 1e-3
CASES = {
    "plain": ({}, []),
    "temperature-top-k-top-p": ({"temperature": 0.8, "top_k": 5, "top_p": 0.9},
                                [TemperatureLogitsWarper(0.8), TopKLogitsWarper(5), TopPLogitsWarper(0.9)]),
}
PROMPT = torch.tensor([[1, 5, 2, 7]])


def sampled_draft(target, **shape):
    draft = make_draft(target, **shape)
    draft.generation_config.tree_sampling = MODE
    return draft


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_trees_keep_the_target_distribution(sampling_target, case):
    kwargs, processors = CASES[case]
    torch.manual_seed(0)
    counts, lengths = sample_counts(sampling_target, sampled_draft(sampling_target, depth=3, top_k=3, total=8),
                                    PROMPT, 600, **kwargs)  # fmt: skip
    assert lengths.count(3) > 0
    joint = exact_joint(sampling_target, PROMPT, LogitsProcessorList(processors))
    assert min(sampling_p_values(counts, joint)) > ALPHA


def test_the_automatic_budget_shapes_sampled_trees_and_keeps_the_distribution(sampling_target, monkeypatch):
    """``tree_total_tokens="auto"``: each round's shape comes from the rounds before it, chosen before drawing."""
    from transformers_poss.generation import budget, sampled_budget

    gentle = budget.CostProfile(key="k", verify_seconds={1: 1.0, 4: 1.05, 16: 1.3, 64: 3.0},
                                draft_context_seconds=0.02, draft_step_seconds=0.02)  # fmt: skip
    monkeypatch.setattr(budget, "load_or_measure_profile", lambda *a, **k: gentle)
    monkeypatch.setattr(budget.TreeBudget, "plain_probe_due", lambda self: False)  # every round a tree round
    shapes = []
    choose = sampled_budget.SampledTreeBudget.choose_shape
    monkeypatch.setattr(sampled_budget.SampledTreeBudget, "choose_shape", lambda self: shapes.append(choose(self))
                        or shapes[-1])  # fmt: skip
    draft = sampled_draft(sampling_target, depth=3, top_k=3, total="auto")
    kwargs, processors = CASES["temperature-top-k-top-p"]
    torch.manual_seed(0)
    counts, lengths = sample_counts(sampling_target, draft, PROMPT, 600, **kwargs)
    assert len(set(shapes)) > 1 and max(lengths) > 2  # the shape moved with what the rounds observed
    joint = exact_joint(sampling_target, PROMPT, LogitsProcessorList(processors))
    assert min(sampling_p_values(counts, joint)) > ALPHA


def test_a_wrong_residual_fails_the_same_test(sampling_target, monkeypatch):
    monkeypatch.setattr(rejection, "residual_weights", lambda target, draft, *masses: target)
    torch.manual_seed(0)
    counts, _ = sample_counts(sampling_target, sampled_draft(sampling_target, depth=3, top_k=3, total=8), PROMPT, 600)
    joint = exact_joint(sampling_target, PROMPT, LogitsProcessorList())
    assert max(sampling_p_values(counts, joint)) < ALPHA


def test_batched_sampled_trees_keep_each_rows_distribution(sampling_target):
    """B = 2 rows sampled together (one left-padded), trees of depth 2 per row (16 nodes shared: 8 per row)."""
    prompts = [torch.tensor([[1, 5, 2, 7]]), torch.tensor([[3, 6]])]
    kwargs, processors = CASES["temperature-top-k-top-p"]
    draft = sampled_draft(sampling_target, depth=2, top_k=3, total=16)
    ids, mask = left_pad(prompts)
    counts = [torch.zeros(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB) for _ in prompts]
    lengths = []
    torch.manual_seed(0)
    for _ in range(500):
        out = sampling_target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=True,
                                       max_new_tokens=4, pad_token_id=PAD, return_dict_in_generate=True, **kwargs)
        for b in range(len(prompts)):
            t1, t2, t3 = out.sequences[b, ids.shape[1] : ids.shape[1] + 3].tolist()
            counts[b][t1, t2, t3] += 1
        lengths += out.acceptance.accepted_lengths
    assert lengths.count(3) > 0
    for prompt, row_counts in zip(prompts, counts):
        joint = exact_joint(sampling_target, prompt, LogitsProcessorList(processors))
        assert min(sampling_p_values(row_counts, joint)) > ALPHA


def test_greedy_output_is_unchanged_by_the_mode():
    target = tiny_llama_target()
    draft = sampled_draft(target, depth=3, top_k=3, total=10)
    prompt = row_prompts([7])[0]
    plain = target.generate(prompt, do_sample=False, max_new_tokens=16)
    assert torch.equal(target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=16), plain)
    prompts = row_prompts([5, 8])
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=12,
                          pad_token_id=PAD)  # fmt: skip
    for b, p in enumerate(prompts):
        solo = target.generate(p, do_sample=False, max_new_tokens=12, pad_token_id=PAD)[0, p.shape[1] :]
        assert out[b, ids.shape[1] : ids.shape[1] + solo.shape[0]].tolist() == solo.tolist()


def test_the_mode_is_saved_and_loaded(tmp_path):
    target = tiny_llama_target()
    draft = sampled_draft(target)
    draft.save_pretrained(tmp_path / "draft")
    loaded = PosSDraftModel.from_pretrained(tmp_path / "draft")
    assert loaded.generation_config.tree_sampling == MODE


def test_clear_errors(sampling_target):
    draft = sampled_draft(sampling_target, depth=2, top_k=2, total=4)
    draft.generation_config.tree_sampling = "draft"
    with pytest.raises(ValueError, match="tree_sampling"):
        sampling_target.generate(PROMPT, assistant_model=draft, do_sample=True, max_new_tokens=3)
    draft.generation_config.tree_sampling = MODE
    draft.generation_config.tree_context_candidates = None  # unset: context candidates give way to sampled trees
    sampling_target.generate(PROMPT, assistant_model=draft, do_sample=True, max_new_tokens=3)
    draft.generation_config.tree_context_candidates = True
    with pytest.raises(ValueError, match="tree_context_candidates"):
        sampling_target.generate(PROMPT, assistant_model=draft, do_sample=True, max_new_tokens=3)
    ids, mask = left_pad([PROMPT, torch.tensor([[3, 6]])])
    with pytest.raises(ValueError, match="tree_context_candidates"):
        sampling_target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=True, max_new_tokens=3,
                                 pad_token_id=PAD)  # fmt: skip
