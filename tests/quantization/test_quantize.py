"""int8 CPU path: per-token Int8Linear, float64 "poss_exact" attention, and lossless speculation on an int8 target."""

import copy
import warnings

import pytest
import torch
from transformers.cache_utils import DynamicCache

from test_generation import assert_same, make_draft, prompts
from transformers_poss import Int8Linear, PosSDraftConfig, PosSDraftModel, quantize_int8, use_exact_attention
from transformers_poss.quantization.int8 import has_int8_activations, is_batch_variant, linear_device, linear_weight
from tree_testing import tiny_gemma3_target, tiny_llama_target


def test_int8_linear_is_close_to_float_and_rows_are_independent():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    quantized = Int8Linear.from_linear(linear)
    x = torch.randn(5, 3, 64)
    out = quantized(x)
    assert out.shape == (5, 3, 48)
    rel = (out - linear(x)).norm() / linear(x).norm()
    assert rel < 0.02
    # a row's output does not depend on the rows computed beside it (bitwise)
    assert torch.equal(quantized(x[2:3, 1:2]), out[2:3, 1:2])
    scaled = x.clone()
    scaled[0] *= 100.0  # a row with huge activations must not change the others
    assert torch.equal(quantized(scaled)[1:], out[1:])
    assert (linear_weight(quantized) - linear.weight).abs().max() < linear.weight.abs().max() / 100


def test_generate_does_not_unpack_an_int8_lm_head(monkeypatch):
    """Finding the lm_head's device must not dequantize it (a vocabulary-sized matrix, at every generate call)."""
    target = quantize_int8(tiny_llama_target())
    draft = quantize_int8(make_draft(target))
    assert linear_device(target.lm_head) == target.lm_head.weight_int8_t.device
    assert_same(target, draft, prompts(1)[0], max_new_tokens=4, do_sample=False)  # the draft caches its head here

    def unpack(self):
        raise AssertionError("the int8 lm_head was dequantized again")

    monkeypatch.setattr(Int8Linear, "dequantized_weight", unpack)
    assert_same(target, draft, prompts(1)[0], max_new_tokens=8, do_sample=False)


def test_exact_attention_matches_sdpa():
    for make in (tiny_llama_target, tiny_gemma3_target):
        target = make()
        exact = copy.deepcopy(target)
        use_exact_attention(exact)
        assert exact.config._attn_implementation == "poss_exact"
        ids = torch.randint(3, 90, (2, 11))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding
        ref, got = target(ids, attention_mask=mask).logits, exact(ids, attention_mask=mask).logits
        assert torch.allclose(ref[0], got[0], atol=1e-5) and torch.allclose(ref[1, 3:], got[1, 3:], atol=1e-5)


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_int8_with_exact_attention_is_bitwise_incremental(make):
    """Last token decoded alone after a prefix == the same token inside a full forward: what lossless needs."""
    target = quantize_int8(make())
    assert has_int8_activations(target) and target.config._attn_implementation == "poss_exact"
    ids = torch.randint(3, 90, (1, 13))
    with torch.no_grad():
        full = target(ids).logits[0, -4:]
        cache = DynamicCache(config=target.config)
        target(ids[:, :-4], cache=cache, use_cache=True)
        step = torch.cat([target(ids[:, i : i + 1], cache=cache, use_cache=True).logits[0] for i in range(9, 13)])
    assert torch.equal(full, step)


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
@pytest.mark.parametrize("shape", [(3, 2, 5), (4, 4, 16)])
def test_int8_target_and_draft_greedy_identical(make, shape):
    target = quantize_int8(make())
    draft = quantize_int8(make_draft(target, *shape))
    assert draft.config._attn_implementation != "poss_exact"  # a draft keeps its own attention
    for prompt in prompts(2):
        assert_same(target, draft, prompt, max_new_tokens=20, do_sample=False)


def test_int8_target_without_exact_attention_is_refused():
    target = quantize_int8(tiny_llama_target(), exact_attention=False)
    draft = make_draft(target)
    with pytest.raises(ValueError, match="use_exact_attention"):
        target.generate(prompts(1)[0], assistant_model=draft, max_new_tokens=4)


def test_torch_ao_int8_target_refused_fp16_weights_allowed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = torch.ao.quantization.quantize_dynamic(tiny_llama_target(), {torch.nn.Linear}, dtype=torch.qint8)
        fp16 = torch.ao.quantization.quantize_dynamic(tiny_llama_target(), {torch.nn.Linear}, dtype=torch.float16)
    assert is_batch_variant(dynamic) and not is_batch_variant(fp16)
    with pytest.raises(ValueError, match="not be lossless"):
        dynamic.generate(prompts(1)[0], assistant_model=make_draft(dynamic), max_new_tokens=4)
    draft = make_draft(fp16)
    for prompt in prompts(2):
        assert_same(fp16, draft, prompt, max_new_tokens=16, do_sample=False)


def test_select_rows_keeps_the_int8_rows_and_a_draft_reads_them():
    """A draft on an int8 target computes its draft-vocabulary logits from the int8 rows of the target head."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 20)
    full = Int8Linear.from_linear(linear)
    index = torch.tensor([3, 0, 17, 5])
    rows = full.select_rows(index)
    x = torch.randn(6, 32)
    assert torch.equal(rows(x), full(x)[:, index])
    assert rows.weight_int8_t.dtype == torch.int8 and rows.out_features == 4
    target = quantize_int8(tiny_llama_target())
    config = PosSDraftConfig.for_target(target.config, num_specialists=1, positions_per_specialist=1, draft_vocab_size=16)
    draft = PosSDraftModel(config).eval()
    draft.draft_to_target.copy_(torch.randperm(target.config.vocab_size)[:16])
    draft.attach_target(target)
    features = torch.randn(2, 3, draft.config.hidden_size)
    expected = target.lm_head(features)[..., draft.draft_to_target]
    got = draft.compute_logits(features)
    head = draft._int8_draft_head()
    assert isinstance(head, Int8Linear) and head.weight_int8_t.dtype == torch.int8
    assert not head.per_token  # one fbgemm call per draft step; the draft only proposes
    assert (got - expected).norm() / expected.norm() < 0.03
