"""Bad tree settings and inputs to generate get a short error; near-ties and a bad cost profile are reported."""

import json
import os
import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import tiny_draft, tiny_llama
from transformers_poss.bench.methods import tree_shape

PROMPT = torch.tensor([[1, 5, 9, 3, 7, 2]])


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def _generate(target, draft, **kwargs):
    return target.generate(PROMPT, assistant_model=draft, max_new_tokens=6, do_sample=False, **kwargs)


# ---------------------------------------------------------------------------------------------------- tree values
@pytest.mark.parametrize("name", ["tree_depth", "tree_top_k", "tree_total_tokens"])
def test_zero_tree_value_is_an_error_not_the_default(target, name):
    draft = tiny_draft(target)
    setattr(draft.generation_config, name, 0)
    with pytest.raises(ValueError, match=f"`{name}` must be an integer >= [12], got 0"):
        _generate(target, draft)


@pytest.mark.parametrize("value", [2.7, "3", True])
def test_non_integer_depths_are_refused(target, value):
    draft = tiny_draft(target)
    draft.generation_config.tree_depth = value
    with pytest.raises(ValueError, match="`tree_depth` must be an integer >= 1"):
        _generate(target, draft)


@pytest.mark.parametrize("spelling", ["Auto", "auto ", " AUTO"])
def test_auto_is_accepted_in_any_case_and_spacing(target, spelling, tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    draft = tiny_draft(target)
    draft.generation_config.tree_total_tokens = spelling
    plain = target.generate(PROMPT, max_new_tokens=6, do_sample=False)
    assert torch.equal(_generate(target, draft), plain)


def test_auto_only_for_total_tokens(target):
    draft = tiny_draft(target)
    draft.generation_config.tree_top_k = "auto"
    with pytest.raises(ValueError, match="only accepted for tree_total_tokens"):
        _generate(target, draft)


def test_draft_tree_zero_depth_and_bench_shape_zero(target):
    draft = tiny_draft(target)
    with pytest.raises(ValueError, match="`tree_depth` must be an integer >= 1, got 0"):
        draft.draft_tree(PROMPT, torch.randn(1, PROMPT.shape[1] - 1, 64), depth=0)
    with pytest.raises(ValueError, match="`tree_total_tokens`"):
        with tree_shape(draft, total_tokens=0):
            pass
    assert draft.generation_config.tree_total_tokens == 60  # untouched


def test_target_on_meta_device(target):
    with torch.device("meta"):
        empty = LlamaForCausalLM(target.config)
    with pytest.raises(ValueError, match="meta device .*load it with real weights"):
        empty.generate(PROMPT, assistant_model=tiny_draft(target), max_new_tokens=4, do_sample=False)


# ---------------------------------------------------------------------------------------------------- near-ties
def test_bf16_greedy_warns_once_and_fp32_does_not(target):
    from transformers_poss.generation import validation

    validation._warned_near_ties.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _generate(target, tiny_draft(target))
    assert not [w for w in caught if "near-ties" in str(w.message)]
    low = tiny_llama().to(torch.bfloat16)
    draft = tiny_draft(low).to(torch.bfloat16)
    assert not validation.is_bit_exact(low) and validation.is_bit_exact(target)
    with pytest.warns(UserWarning, match="bfloat16 target matches plain generate only up to floating-point near-ties"):
        _generate(low, draft)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _generate(low, draft)
    assert not [w for w in caught if "near-ties" in str(w.message)]  # once


# ---------------------------------------------------------------------------------------------------- cost profile
@pytest.mark.parametrize("content", [
    json.dumps({"key": "k", "verify_seconds": {"1": 0.0, "2": 0.0, "4": 0.0}}),
    json.dumps({"key": "k", "verify_seconds": {}}),
    "\0" * 64,
    json.dumps({"key": "k", "verify_seconds": {"1": 0.01, "2": 0.02}, "draft_step_seconds": -1}),
])
def test_corrupt_cost_profile_is_measured_again_with_a_warning(tmp_path, monkeypatch, target, content):
    from transformers_poss.generation import budget

    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    path = os.path.join(budget.cache_dir(), budget.profile_key(target, None, 10) + ".json")
    with open(path, "w") as handle:
        handle.write(content)
    with pytest.warns(UserWarning, match="cost profile .* is unusable .*measuring it again"):
        profile = budget.load_or_measure_profile(target, None, top_k=10, sizes=(1, 2, 4))
    assert budget.TreeBudget(profile, depth=2, max_nodes=4).plain_rate > 0
    assert budget.usable_profile(budget.CostProfile.from_json(open(path).read()))  # the cache was rewritten




@pytest.mark.parametrize("settings, named", [({"guidance_scale": 1.5}, "guidance_scale=1.5"),
                                             ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
                                             ({"num_beams": 2}, "num_beams=2")])
def test_options_that_change_the_batch_are_refused_before_any_work(target, settings, named):
    """Options that run more rows than the prompts (guidance's unconditional batch, returned sequences, beams)."""
    draft = tiny_draft(target)
    ids = torch.randint(3, 100, (1, 5))
    with pytest.raises(ValueError, match=named):
        target.generate(ids, assistant_model=draft, max_new_tokens=4, **settings)
