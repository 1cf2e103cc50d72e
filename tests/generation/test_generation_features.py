"""Tree speculation with drafts that read several target layers (``feature_layers``), in both layer styles, with and
without an own lm_head: greedy token-identical to plain generate (B = 1, batches, chains, the automatic budget's
hand-over, ``custom_generate``), sampling keeps the target distribution, and only the needed hidden states are asked
for."""

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from helpers import FEATURE_VARIANTS, randomize_norms
from test_batched_generation import assert_rows_identical, row_prompts
from test_generation import assert_same, exact_joint, prompts, sample_counts, sampling_p_values
from test_handover import FLAT
from transformers_poss import PosSDraftConfig, PosSDraftModel
from transformers_poss.generation import budget as budget_module
from transformers_poss.generation import generate as poss_generate
from transformers_poss.generation.budget import TreeBudget
from tree_testing import one_thread, tiny_gemma3_target, tiny_llama_target, train_draft_briefly  # noqa: F401

TARGETS = {"llama": lambda: tiny_llama_target(layers=4), "gemma3": tiny_gemma3_target}


def feature_draft(target, variant, shape=(4, 4, 16), specialists=3, seed=1, **kwargs):
    torch.manual_seed(seed)
    settings = {**FEATURE_VARIANTS[variant], **kwargs}
    config = PosSDraftConfig.for_target(target.config, num_specialists=specialists, positions_per_specialist=1,
                                        **settings)  # fmt: skip
    draft = randomize_norms(PosSDraftModel(config).eval()).attach_target(target)
    gen = draft.generation_config
    gen.tree_depth, gen.tree_top_k, gen.tree_total_tokens = shape
    return draft


@pytest.fixture(scope="module")
def trained():
    """One briefly trained feature draft per variant on the tiny 4-layer Llama (several tokens accepted per round)."""
    target = tiny_llama_target(layers=4)
    drafts = {}
    for variant in FEATURE_VARIANTS:
        drafts[variant] = train_draft_briefly(target, feature_draft(target, variant), prompts(3), steps=150)
    return target, drafts


def requested_hidden_states(target):
    """Record ``output_hidden_states`` of every target forward; returns (list, hook handle)."""
    seen = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("output_hidden_states")), with_kwargs=True
    )
    return seen, handle


# ---------------------------------------------------------------- greedy, B = 1
@pytest.mark.parametrize("make", sorted(TARGETS))
@pytest.mark.parametrize("variant", sorted(FEATURE_VARIANTS))
@pytest.mark.parametrize("shape", [(3, 2, 5), (6, 10, 60)])
def test_greedy_identical_with_random_feature_draft(make, variant, shape):
    target = TARGETS[make]()
    draft = feature_draft(target, variant, shape)
    for prompt in prompts(2):
        assert_same(target, draft, prompt, max_new_tokens=16, do_sample=False)


@pytest.mark.parametrize("variant", sorted(FEATURE_VARIANTS))
def test_greedy_identical_with_trained_feature_draft_and_only_needed_states(trained, variant):
    target, drafts = trained
    draft = drafts[variant]
    longest = 0
    for prompt in prompts(3):
        expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
        seen, handle = requested_hidden_states(target)
        out = target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False,
                              return_dict_in_generate=True)  # fmt: skip
        handle.remove()
        assert out.sequences.tolist() == expected.tolist()
        longest = max([longest, *out.acceptance.accepted_lengths])
        wanted = draft.config.feature_layers if draft.config.feature_layers is not None else -1
        assert seen and all(request == wanted for request in seen)  # prefill and every verification
    assert longest > 1  # accepted runs were gathered from the tree's target features


# ---------------------------------------------------------------- batches and chains
@pytest.mark.parametrize("variant", sorted(FEATURE_VARIANTS))
def test_batched_rows_identical_with_trained_feature_draft(trained, variant):
    target, drafts = trained
    out = assert_rows_identical(target, drafts[variant], row_prompts([8, 5, 11]), max_new_tokens=20)
    assert max(out.acceptance.accepted_lengths) > 1


@pytest.mark.parametrize("make", sorted(TARGETS))
@pytest.mark.parametrize("variant", ["eagle3-fl", "eagle3-fl-head"])
def test_batched_rows_identical_with_random_feature_draft(make, variant):
    target = TARGETS[make]()
    assert_rows_identical(target, feature_draft(target, variant, (3, 3, 8)), row_prompts([6, 9, 4]), max_new_tokens=12)


@pytest.mark.parametrize("variant", sorted(FEATURE_VARIANTS))
def test_chains_identical_single_row_and_batched(trained, variant):
    """top_k = 1: every tree is a chain, verified on the plain causal path."""
    target, drafts = trained
    draft = drafts[variant]
    previous = draft.generation_config.tree_top_k, draft.generation_config.tree_total_tokens
    draft.generation_config.tree_top_k, draft.generation_config.tree_total_tokens = 1, 5
    try:
        longest = 0
        for prompt in prompts(2):
            out = assert_same(target, draft, prompt, max_new_tokens=20, do_sample=False)
            longest = max([longest, *out.acceptance.accepted_lengths])
        assert longest > 1
        assert_rows_identical(target, draft, row_prompts([7, 4]), max_new_tokens=16)
    finally:
        draft.generation_config.tree_top_k, draft.generation_config.tree_total_tokens = previous


# ---------------------------------------------------------------- automatic budget, custom_generate
@pytest.mark.parametrize("variant", ["eagle2-fl", "eagle3-fl-head"])
def test_auto_budget_measures_and_hands_over(trained, variant, monkeypatch):
    target, drafts = trained
    draft = drafts[variant]
    profile = budget_module.measure_draft_seconds(draft, top_k=4, context_length=16, repeats=1)
    assert all(seconds >= 0 for seconds in profile)  # the timing runs on k*H-wide features
    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: FLAT)
    monkeypatch.setattr(TreeBudget, "should_fall_back", lambda self: self.rounds >= 2)
    draft.generation_config.tree_total_tokens = "auto"
    draft.generation_config.tree_max_total_tokens = 16
    try:
        for prompt in prompts(2):
            out = assert_same(target, draft, prompt, max_new_tokens=20, do_sample=False)
            assert out.acceptance.fell_back_to_plain and out.acceptance.plain_steps > 0
    finally:
        draft.generation_config.tree_total_tokens = 16


def test_custom_generate_with_feature_draft(trained):
    target, drafts = trained
    draft = drafts["eagle3-fl"]
    for prompt in prompts(2):
        expected = target.generate(prompt, max_new_tokens=16, do_sample=False)
        out = target.generate(prompt, custom_generate=poss_generate, draft=draft, max_new_tokens=16, do_sample=False)
        assert out.tolist() == expected.tolist()


def test_profile_key_tells_feature_drafts_apart(trained):
    target, drafts = trained
    keys = {budget_module.profile_key(target, draft, top_k=4) for draft in drafts.values()}
    assert len(keys) == len(drafts)


# ---------------------------------------------------------------- sampling
@pytest.mark.parametrize("variant, seed", [("eagle3-fl-head", 1), ("eagle2-fl", 5)])
def test_sampling_keeps_the_target_distribution_with_feature_draft(variant, seed):
    """The chi-square machinery of test_generation with a random feature draft on a 2-layer, 8-token target (seeds
    whose drafts get depth-2 acceptances)."""
    target = tiny_llama_target(vocab_size=8, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6)
    target.generation_config.eos_token_id = None
    layers = [0, 1, 2] if variant == "eagle3-fl-head" else [2, 1]
    draft = feature_draft(target, variant, shape=(2, 3, 8), specialists=2, seed=seed, feature_layers=layers)
    assert draft.config.feature_layers == layers
    prompt = torch.tensor([[1, 5, 2, 7]])
    torch.manual_seed(0)
    counts, lengths = sample_counts(target, draft, prompt, 600, temperature=0.7, top_p=0.9)
    assert lengths.count(3) > 0  # depth-2 acceptances happened
    joint = exact_joint(target, prompt, LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]))
    assert min(sampling_p_values(counts, joint)) > 1e-3


# ---------------------------------------------------------------- mismatches
def test_generate_refuses_feature_layers_the_target_lacks():
    draft = feature_draft(tiny_llama_target(layers=4), "eagle3-fl")  # reads hidden_states[4]
    small = tiny_llama_target(layers=2)
    with pytest.raises(ValueError, match=r"feature layer\(s\) \[4\] beyond the target's 2 layers"):
        small.generate(prompts(1)[0], assistant_model=draft, max_new_tokens=4)


# ---------------------------------------------------------------- the real SmolLM2 target
@pytest.mark.integration
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_smollm2_random_eagle3_draft_identical(quantize):
    """A randomly initialised EAGLE-3 style draft reading SmolLM2's hidden states [2, 15, 27] (its 30 layers' EAGLE-3
    default): greedy token-identical to plain generate, fp32 and on the int8 exact path."""
    from test_generation_real import _chat_ids, _load, _questions

    from transformers_poss import quantize_int8
    from transformers_poss.configuration_poss import eagle3_feature_layers

    target, tokenizer = _load("smollm2-135m-instruct")  # a fresh copy: quantized in place
    layers = eagle3_feature_layers(target.config.num_hidden_layers)
    assert layers == [2, 15, 27]
    torch.manual_seed(0)
    config = PosSDraftConfig.for_target(target.config, num_specialists=2, feature_layers=layers, layer_style="eagle3")
    draft = PosSDraftModel(config).eval().attach_target(target)
    gen = draft.generation_config
    gen.tree_depth, gen.tree_top_k, gen.tree_total_tokens = 3, 3, 8
    if quantize == "int8":
        quantize_int8(target)
        draft = quantize_int8(draft)
    for text in _questions(2):
        ids = _chat_ids(tokenizer, text)
        expected = target.generate(ids, max_new_tokens=32, do_sample=False)
        out = target.generate(ids, assistant_model=draft, max_new_tokens=32, do_sample=False)
        assert out.tolist() == expected.tolist(), text
