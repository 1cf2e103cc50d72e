"""The tree loop offered as a ``generate(custom_generate=...)`` callable."""

import pytest
import torch

from transformers_poss.generation import (PosSGenerateOutput, disable_tree_generation, enable_tree_generation,
                                          generate as poss_generate)
from tree_testing import one_thread, tiny_gemma3_target, tiny_llama_target  # noqa: F401 - autouse fixture

from helpers import tiny_draft


def _prompt(length=9, seed=3, vocab=96):
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_custom_generate_is_token_identical_to_greedy(make):
    target = make()
    draft = tiny_draft(target)
    draft.generation_config.tree_depth, draft.generation_config.tree_top_k = 4, 3
    draft.generation_config.tree_total_tokens = 10
    prompt = _prompt()
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    out = target.generate(prompt, custom_generate=poss_generate, draft=draft, max_new_tokens=20, do_sample=False,
                          return_dict_in_generate=True)
    assert isinstance(out, PosSGenerateOutput)
    assert out.sequences.tolist() == expected.tolist()
    assert out.acceptance.num_rounds >= 1
    assert 1 + sum(out.acceptance.accepted_lengths) == expected.shape[1] - prompt.shape[1]  # + the prefill token


def test_custom_generate_does_not_need_the_hook():
    target = tiny_llama_target()
    draft = tiny_draft(target)
    prompt = _prompt(seed=4)
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    disable_tree_generation()
    try:
        out = target.generate(prompt, custom_generate=poss_generate, draft=draft, max_new_tokens=12)
    finally:
        enable_tree_generation()
    assert out.tolist() == expected.tolist()


def test_custom_generate_batch_and_errors():
    target = tiny_llama_target()
    draft = tiny_draft(target)
    prompts = torch.cat([_prompt(seed=5), _prompt(seed=6)])
    expected = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False)
    out = target.generate(prompts, attention_mask=torch.ones_like(prompts), custom_generate=poss_generate,
                          draft=draft, max_new_tokens=8, do_sample=False)
    assert out.tolist() == expected.tolist()
    with pytest.raises(ValueError, match="draft="):
        target.generate(prompts[:1], custom_generate=poss_generate, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_beams"):
        target.generate(prompts[:1], custom_generate=poss_generate, draft=draft, num_beams=2, max_new_tokens=4)
