"""The target's feature pass attends block-causally on CPUs: the same features as SDPA with the padding mask."""

import pytest
import torch

from helpers import tiny_llama
from transformers_poss._transformers_compat import attn_implementation
from transformers_poss.training import feature_attention
from transformers_poss.training.feature_inputs import TargetFeatures


def _batch(left: bool = False):
    torch.manual_seed(0)
    tokens = torch.randint(1, 128, (3, 23))
    mask = torch.ones(3, 23, dtype=torch.long)
    for row, pad in enumerate((0, 5, 17)):
        if pad:
            if left:
                mask[row, :pad] = 0
            else:
                mask[row, -pad:] = 0
    return tokens, mask


@pytest.mark.parametrize("feature_layers", [None, [1, 2]])
def test_block_causal_features_equal_sdpa_on_real_positions(feature_layers, monkeypatch):
    target = tiny_llama()
    tokens, mask = _batch()
    calls = []
    real = feature_attention.block_causal_attention
    monkeypatch.setattr(feature_attention, "block_causal_attention", lambda *a: calls.append(1) or real(*a))
    features = TargetFeatures(target, feature_layers)
    got, got_last = features.compute(tokens, mask)
    assert calls and attn_implementation(target.config) == "sdpa"  # used, and the target is switched back
    calls.clear()
    monkeypatch.setattr(feature_attention, "right_padded", lambda mask: False)  # forces SDPA with the mask
    want, want_last = features.compute(tokens, mask)
    assert not calls
    real_positions = mask.bool()
    torch.testing.assert_close(got[real_positions], want[real_positions], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_last[real_positions], want_last[real_positions], rtol=1e-5, atol=1e-5)
    # the comparison can fail: a different token changes the features after it
    changed = tokens.clone()
    changed[0, 3] = (changed[0, 3] % 127) + 1
    other = features.compute(changed, mask)[0]
    assert not torch.allclose(other[0, 4:], got[0, 4:], atol=1e-4)


def test_left_padding_and_other_implementations_keep_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(feature_attention, "block_causal_attention", lambda *a: calls.append(1))
    target = tiny_llama()
    tokens, mask = _batch(left=True)
    assert not feature_attention.right_padded(mask) and feature_attention.right_padded(_batch()[1])
    TargetFeatures(target).compute(tokens, mask)
    target.set_attn_implementation("eager")
    TargetFeatures(target).compute(*_batch())
    assert not calls and attn_implementation(target.config) == "eager"


def test_special_calls_go_to_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, h, 9, 8, generator=generator) for h in (4, 2, 2))
    positions = torch.arange(9)
    distance = positions[:, None] - positions[None, :]
    mask = ((distance >= 0) & (distance < 3))[None, None]  # a sliding window of 3 keys
    want = sdpa_attention_forward(module, query, key, value, mask, sliding_window=3)[0]
    got = feature_attention.block_causal_forward(module, query, key, value, mask, sliding_window=3)[0]
    torch.testing.assert_close(got, want)
    plain = feature_attention.block_causal_forward(module, query, key, value, mask)[0]
    assert not torch.allclose(plain, want)  # the plain path ignores the mask: it is for causal masks only
