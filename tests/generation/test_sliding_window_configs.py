"""Targets whose config sets `sliding_window` but no `layer_types` (Mistral, Phi-3, Mixtral, Starcoder2 style): every
layer slides, and batched tree speculation must apply that window as plain batched `generate` does."""

import pytest
import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
)

from test_batched_generation import PAD, assert_rows_identical, left_pad, row_prompts
from test_generation import make_draft
from tree_testing import one_thread  # noqa: F401 - autouse fixture

VOCAB = 96
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)


def tiny_mistral(window=4, attn="sdpa"):
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(sliding_window=window, attn_implementation=attn, **SIZES)).eval()


def tiny_phi3(window=4, attn="sdpa"):
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(sliding_window=window, attn_implementation=attn, **SIZES)).eval()


def tiny_mixtral(window=4, attn="sdpa"):
    torch.manual_seed(0)
    config = MixtralConfig(sliding_window=window, num_local_experts=2, num_experts_per_tok=1,
                           attn_implementation=attn, **SIZES)  # fmt: skip
    return MixtralForCausalLM(config).eval()


@pytest.mark.parametrize("make", [tiny_mistral, tiny_phi3, tiny_mixtral])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_rows_equal_plain_batched_generate(make, attn):
    target = make(attn=attn)
    assert getattr(target.config, "layer_types", None) is None and target.config.sliding_window == 4
    prompts = row_prompts([9, 4, 7], seed=3)
    draft = make_draft(target, depth=3, top_k=3, total=8)
    ids, mask = left_pad(prompts)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    spec = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=20,
                           pad_token_id=PAD)  # fmt: skip
    assert torch.equal(spec, plain)
    assert_rows_identical(target, draft, prompts, max_new_tokens=20)  # and each row equals its own generate


def test_the_window_matters_for_these_prompts():
    """The prompts are longer than the window: with no window the same weights give other outputs."""
    windowed, full = tiny_mistral(window=4), tiny_mistral(window=None)
    full.load_state_dict(windowed.state_dict())
    ids, mask = left_pad(row_prompts([9, 4, 7], seed=3))
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    assert not torch.equal(windowed.generate(ids, **kwargs), full.generate(ids, **kwargs))
