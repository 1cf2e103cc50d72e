"""Tiny random models shared by the tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from transformers_poss import PosSDraftConfig, PosSDraftModel


def tiny_llama(vocab_size=128, hidden_size=64, layers=2, heads=4, kv_heads=2, seed=0, **kwargs):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        **kwargs,
    )
    return LlamaForCausalLM(config).eval()


def tiny_draft(target, num_specialists=2, positions_per_specialist=1, seed=1, **kwargs):
    torch.manual_seed(seed)
    config = PosSDraftConfig.for_target(
        target.config, num_specialists=num_specialists, positions_per_specialist=positions_per_specialist, **kwargs
    )
    return PosSDraftModel(config).eval().attach_target(target)


def motif_sequences(count=24, seed=0, vocab=128):
    """Token sequences with a learnable pattern (a repeated random motif) and an assistant span (training tests)."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(count):
        length = int(torch.randint(14, 30, (1,), generator=generator))
        motif = torch.randint(3, vocab, (5,), generator=generator)
        tokens = motif.repeat(length // 5 + 1)[:length]
        mask = torch.zeros(length, dtype=torch.long)
        mask[length // 3 :] = 1
        items.append({"input_ids": tokens, "assistant_mask": mask})
    return items


# draft variants that read several target layers (EAGLE-3 style), for a tiny_llama(layers=4) target
FEATURE_VARIANTS = {
    "eagle2-fl": dict(feature_layers=[1, 2, 4]),
    "eagle3-fl": dict(feature_layers=[1, 2, 4], layer_style="eagle3"),
    "eagle3-fl-head": dict(feature_layers=[0, 3], layer_style="eagle3", own_lm_head=True),
    "eagle3-post-norm": dict(layer_style="eagle3"),
}


def randomize_norms(model, seed=3):
    """Give every RMSNorm weight of ``model`` random values (freshly built norms are all ones, which would hide a
    norm applied to the wrong tensor)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))
    return model


def selected_features(target, ids, layers):
    """`[B, T, k*H]`: the target's hidden states ``layers`` (None: the post-norm one) concatenated, for ``ids``."""
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in (layers or [-1])], dim=-1)
