import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache

from transformers_poss.speculation.masks import tree_verification_mask
from transformers_poss.speculation.target_cache import (
    UnsupportedCacheError,
    check_cache_supported,
    compact_cache,
    finish_cache_after_tree,
    prepare_cache_for_tree,
)
from tree_testing import one_thread  # noqa: F401 - autouse fixture
from tree_testing import random_tree, tiny_gemma3_target, tiny_llama_target


def _prefill(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    prepare_cache_for_tree(cache)
    return cache


def _verify(model, cache, tree, dtype=None):
    past = cache.get_seq_length()
    mask = tree_verification_mask(cache, model.config, tree.tree_mask, tree.depths, dtype=dtype)
    with torch.no_grad():
        out = model(
            input_ids=tree.tokens[None],
            attention_mask=mask,
            position_ids=(tree.depths + past)[None],
            cache=cache,
            use_cache=True,
        )
    return out.logits[0]


def _path(tree, node):
    return tree.tree_mask[node].nonzero().squeeze(-1)


def _linear_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0]


@pytest.mark.parametrize(
    "make, attn",
    [(tiny_llama_target, "sdpa"), (tiny_llama_target, "eager"), (tiny_gemma3_target, "sdpa"), (tiny_gemma3_target, "eager")],
)
def test_tree_logits_equal_linear_paths(make, attn):
    model = make(attn=attn)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 96, (1, 9), generator=gen)  # longer than the sliding window (4)
    cache = _prefill(model, prompt[:, :-1])
    tree = random_tree(int(prompt[0, -1]), num_nodes=12, max_depth=5, vocab_size=96, generator=gen)
    dtype = None if attn == "sdpa" else torch.float32
    logits = _verify(model, cache, tree, dtype)
    for node in range(tree.num_nodes):
        path_tokens = tree.tokens[_path(tree, node)]
        ids = torch.cat([prompt[0, :-1], path_tokens])[None]
        torch.testing.assert_close(logits[node], _linear_logits(model, ids)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_compaction_keeps_exactly_the_accepted_path(make):
    """Several rounds of verify + compact (non-contiguous paths) leave the cache of the linear sequence."""
    model = make()
    gen = torch.Generator().manual_seed(2)
    sequence = torch.randint(3, 96, (1, 6), generator=gen)
    cache = _prefill(model, sequence[:, :-1])
    for _ in range(5):
        tree = random_tree(int(sequence[0, -1]), num_nodes=10, max_depth=4, vocab_size=96, generator=gen)
        logits = _verify(model, cache, tree)
        deepest = [i for i in range(tree.num_nodes) if tree.depths[i] == tree.max_depth][-1]
        path = _path(tree, deepest)
        assert not torch.equal(path, torch.arange(path.shape[0])), "the test needs a non-contiguous path"
        compact_cache(cache, tree.num_nodes, path)
        bonus = logits[deepest].argmax()
        sequence = torch.cat([sequence, tree.tokens[path[1:]][None], bonus.view(1, 1)], dim=-1)
        assert cache.get_seq_length() == sequence.shape[1] - 1

    # the compacted cache equals the cache of the same sequence computed linearly
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(sequence[:, :-1], cache=reference, use_cache=True)
        step = model(sequence[:, -1:], cache=cache, use_cache=True).logits[0, -1]
    for ours, theirs in zip(cache.layers, reference.layers):
        rows = theirs.keys.shape[-2]
        torch.testing.assert_close(ours.keys[..., -rows - 1 : -1, :], theirs.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step, _linear_logits(model, sequence)[-1], atol=1e-4, rtol=1e-4)


def test_sliding_window_layers_trimmed_back_to_window():
    model = tiny_gemma3_target(window=4)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 96, (1, 8), generator=gen)
    cache = _prefill(model, prompt[:, :-1])
    tree = random_tree(int(prompt[0, -1]), num_nodes=9, max_depth=3, vocab_size=96, generator=gen)
    _verify(model, cache, tree)
    compact_cache(cache, tree.num_nodes, _path(tree, tree.num_nodes - 1))
    sliding, full = cache.layers[0], cache.layers[1]
    assert sliding.keys.shape[-2] == 3  # window - 1
    assert full.keys.shape[-2] == sliding.get_seq_length() == cache.get_seq_length()
    finish_cache_after_tree(cache)  # back to the stock behaviour: plain decoding keeps trimming to the window
    assert not sliding.record_past
    with torch.no_grad():
        model(torch.tensor([[7, 8]]), cache=cache, use_cache=True)
    assert sliding.keys.shape[-2] == 3


def test_mask_mapping_per_layer_type():
    model = tiny_gemma3_target(window=4)
    prompt = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(4))
    cache = _prefill(model, prompt)
    tree = random_tree(5, num_nodes=5, max_depth=2, vocab_size=96, generator=torch.Generator().manual_seed(0))
    masks = tree_verification_mask(cache, model.config, tree.tree_mask, tree.depths)
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert masks["full_attention"].shape == (1, 1, 5, 7 + 5)
    assert masks["sliding_attention"].shape == (1, 1, 5, 3 + 5)
    # a depth-2 node at index 9 sees context positions 6 and 7 only... position 6 (> 9 - 4)
    depth2 = int((tree.depths == 2).nonzero()[0])
    assert masks["sliding_attention"][0, 0, depth2, :3].tolist() == [False, False, True]


def test_context_mask_hides_padding():
    model = tiny_llama_target()
    cache = _prefill(model, torch.randint(3, 96, (1, 5)))
    tree = random_tree(5, num_nodes=4, max_depth=2, vocab_size=96, generator=torch.Generator().manual_seed(0))
    context = torch.tensor([False, False, True, True, True])
    mask = tree_verification_mask(cache, model.config, tree.tree_mask, tree.depths, context_mask=context)
    assert mask.shape == (1, 1, 4, 9)
    assert not mask[0, 0, :, :2].any() and mask[0, 0, :, 2:5].all()
    additive = tree_verification_mask(cache, model.config, tree.tree_mask, tree.depths, context, torch.float32)
    assert additive.dtype == torch.float32 and torch.equal(additive == 0, mask)


def test_refuses_unsupported_caches():
    model = tiny_llama_target()
    with pytest.raises(UnsupportedCacheError, match="static"):
        check_cache_supported(StaticCache(config=model.config, max_cache_len=32))
    with pytest.raises(UnsupportedCacheError, match="offloaded"):
        check_cache_supported(DynamicCache(config=model.config, offloading=True))

    class QuantizedLikeLayer(DynamicLayer):
        pass

    cache = DynamicCache(config=model.config)
    cache.layers[0] = QuantizedLikeLayer()
    with pytest.raises(UnsupportedCacheError, match="QuantizedLikeLayer"):
        check_cache_supported(cache)
    check_cache_supported(DynamicCache(config=model.config))  # the default is fine
    check_cache_supported(None)
