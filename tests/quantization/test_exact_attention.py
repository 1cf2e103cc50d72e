"""``poss_exact`` attention: masks as an additive float64 bias, built once per forward and reused across layers."""

import pytest
import torch

import transformers_poss.quantization.exact_attention as exact_attention


def reference(query, key, value, mask):
    """Float64 attention that selects the lowest score where a bool mask is False (adds an additive mask): the
    definition the biased computation must match bit for bit. Query heads sharing a key head are stacked the same way
    (a float64 product over another layout may round a last bit differently)."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    stacked = (query.double() * head_dim**-0.5).reshape(batch, kv_heads, groups * q_len, head_dim)
    scores = (stacked @ key.double().transpose(-1, -2)).view(batch, kv_heads, groups, q_len, k_len)
    if mask is None:
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)[None, None]
    mask = mask.view(batch, kv_heads, groups, q_len, k_len) if mask.shape[1] == q_heads else mask[:, :, None]
    lowest = torch.finfo(torch.float64).min
    scores = torch.where(mask, scores, lowest) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * q_len, k_len)
    out = (weights @ value.double()).to(query.dtype).view(batch, q_heads, q_len, head_dim)
    return out.transpose(1, 2).contiguous()


def random_case(seed):
    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, groups = 1 + seed % 2, 1 + seed % 3, 1 + seed % 4
    q_len, head_dim = 1 + seed % 17, 8 * (1 + seed % 3)
    k_len = q_len + seed % 40
    query = torch.randn(batch, kv_heads * groups, q_len, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, k_len, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, k_len, head_dim, generator=generator)
    kind = seed % 4
    if kind == 0:
        mask = None
    elif kind == 1:
        mask = torch.rand(batch, 1, q_len, k_len, generator=generator) > 0.3
    elif kind == 2:
        mask = torch.rand(batch, kv_heads * groups, q_len, k_len, generator=generator) > 0.3
    else:
        seen = torch.rand(batch, 1, q_len, k_len, generator=generator) > 0.3
        mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)
    return query, key, value, mask


@pytest.mark.parametrize("seed", range(48))
def test_bias_gives_the_bits_of_selecting_the_lowest_score(seed):
    query, key, value, mask = random_case(seed)
    expected = reference(query, key, value, mask)
    assert torch.equal(exact_attention.exact_attention_forward(None, query, key, value, mask)[0], expected)
    # the next layer of the same forward gets the same mask object: served from the cache, same bits
    assert torch.equal(exact_attention.exact_attention_forward(None, query, key, value, mask)[0], expected)


def test_a_new_or_modified_mask_is_not_served_from_the_cache():
    query, key, value, _ = random_case(5)
    first = torch.rand(1, 1, query.shape[2], key.shape[2]) > 0.5
    first[..., 0] = True
    exact_attention.exact_attention_forward(None, query, key, value, first)
    second = ~first
    second[..., 0] = True
    assert torch.equal(exact_attention.exact_attention_forward(None, query, key, value, second)[0],
                       reference(query, key, value, second))
    first[..., 1:] = ~first[..., 1:]  # the cached mask changed in place
    assert torch.equal(exact_attention.exact_attention_forward(None, query, key, value, first)[0],
                       reference(query, key, value, first))


def test_a_row_has_the_same_bits_alone_and_beside_other_rows():
    """A tree node verified beside its siblings (masked from each other) gets the bits it gets decoded alone."""
    torch.manual_seed(0)
    context, nodes = 30, 6
    key, value = torch.randn(1, 2, context + nodes, 16), torch.randn(1, 2, context + nodes, 16)
    query = torch.randn(1, 6, nodes, 16)
    parents = [-1, 0, 0, 1, 1, 3]  # node i sees the context, its ancestors and itself
    mask = torch.zeros(1, 1, nodes, context + nodes, dtype=torch.bool)
    mask[..., :context] = True
    for node in range(nodes):
        ancestor = node
        while ancestor >= 0:
            mask[0, 0, node, context + ancestor] = True
            ancestor = parents[ancestor]
    tree = exact_attention.exact_attention_forward(None, query, key, value, mask)[0]
    for node in range(nodes):
        seen = mask[0, 0, node].nonzero()[:, 0]
        alone = exact_attention.exact_attention_forward(
            None, query[:, :, node : node + 1], key[:, :, seen], value[:, :, seen], None)[0]
        assert torch.equal(alone, tree[:, node : node + 1])
