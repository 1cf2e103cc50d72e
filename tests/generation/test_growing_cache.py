"""`growing_cache`: the same decoding as transformers' DynamicCache, with appends that copy only the new columns."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

from transformers_poss.speculation.target_cache import MIN_CAPACITY, GrowingLayer, growing_cache


def tiny_llama(**overrides):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **overrides)
    return LlamaForCausalLM(config).eval()


def test_batched_greedy_generation_matches_the_dynamic_cache():
    model = tiny_llama()
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :2] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MIN_CAPACITY + 20, do_sample=False,
                  pad_token_id=0)  # grows past the first capacity
    expected = model.generate(**kwargs, cache=DynamicCache(config=model.config))
    cache = growing_cache(model)
    got = model.generate(**kwargs, cache=cache)
    assert torch.equal(got, expected)
    layer = cache.layers[0]
    assert isinstance(layer, GrowingLayer)
    assert layer.keys.shape[-2] == got.shape[1] - 1 and layer._storage[0].shape[-2] >= layer.keys.shape[-2]
    assert layer.keys.data_ptr() == layer._storage[0].data_ptr()  # a view of the buffer, not a copy


def test_update_writes_only_into_the_buffer_and_handles_replaced_keys():
    layer = GrowingLayer()
    first = torch.randn(2, 1, 5, 4)
    keys, _ = layer.update(first, first + 1)
    buffer = layer._storage[0]
    step = torch.randn(2, 1, 1, 4)
    keys, values = layer.update(step, step + 1)
    assert layer._storage[0] is buffer  # no reallocation below the capacity
    assert torch.equal(keys, torch.cat([first, step], dim=-2)) and torch.equal(values, torch.cat([first, step], -2) + 1)
    layer.keys, layer.values = keys[:1].clone(), values[:1].clone()  # e.g. a row selection replaced them
    keys, _ = layer.update(step[:1], step[:1])
    assert keys.shape == (1, 1, 7, 4) and torch.equal(keys[:, :, :6], torch.cat([first, step], dim=-2)[:1])
    layer.crop(-2)  # a crop keeps the view; the next update writes after it
    keys, _ = layer.update(step[:1] * 3, step[:1])
    assert keys.shape[-2] == 6 and torch.equal(keys[:, :, -1:], step[:1] * 3)


def test_only_full_attention_layers_are_replaced():
    model = tiny_llama(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    layers = growing_cache(model).layers
    assert type(layers[0]) is not GrowingLayer and not isinstance(layers[0], GrowingLayer)
    assert isinstance(layers[1], GrowingLayer) and isinstance(layers[1], DynamicLayer)


def test_the_tree_loop_runs_on_a_growing_cache_and_stays_lossless():
    from transformers_poss import PosSDraftConfig, PosSDraftModel

    target = tiny_llama()
    draft = PosSDraftModel(PosSDraftConfig.for_target(target.config, num_specialists=2, positions_per_specialist=2))
    draft.attach_target(target)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=MIN_CAPACITY + 10, min_new_tokens=MIN_CAPACITY + 10, do_sample=False, pad_token_id=0)
    plain = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    assert all(isinstance(layer, GrowingLayer) for layer in out.cache.layers)
    assert out.cache.get_seq_length() == plain.shape[1] - 1
