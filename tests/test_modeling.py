"""PosSDraftConfig / PosSDraftModel: validation, forward, caches, drafting, round trips."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModel

from helpers import tiny_draft, tiny_llama
from transformers_poss import PosSDraftCache, PosSDraftConfig, PosSDraftModel, PosSProposer


# ------------------------------------------------------------------ config
def test_for_target_copies_shape_and_fingerprint():
    target = tiny_llama()
    config = PosSDraftConfig.for_target(target.config, num_specialists=3, positions_per_specialist=2, name_or_path="me/tiny")
    assert config.training_depth == 6
    assert (config.hidden_size, config.vocab_size, config.num_key_value_heads) == (64, 128, 2)
    assert config.target_model_type == "llama" and config.target_name_or_path == "me/tiny"
    assert config.specialist_for_step(0) == 0 and config.specialist_for_step(3) == 1
    assert config.specialist_for_step(99) == 2  # beyond the trained depth: last specialist


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_specialists": 0}, "num_specialists"),
        ({"positions_per_specialist": -1}, "positions_per_specialist"),
        ({"num_attention_heads": 5, "hidden_size": 64, "num_key_value_heads": 5}, "not divisible"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple"),
        ({"tree_total_tokens": 1}, "at least 2"),
        ({"draft_vocab_size": 10**9}, "exceeds"),
        ({"num_specialists": 2, "positions_per_specialist": 2, "training_depth": 3}, "derived"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ],
)
def test_invalid_config_values_are_refused(kwargs, message):
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        PosSDraftConfig(**base)


# ------------------------------------------------------------------ attach
def test_attach_refuses_mismatched_target():
    target = tiny_llama()
    draft = tiny_draft(target)
    with pytest.raises(ValueError, match="vocab size"):
        draft.attach_target(tiny_llama(vocab_size=256))
    with pytest.raises(ValueError, match="hidden size"):
        draft.attach_target(tiny_llama(hidden_size=32, heads=2, kv_heads=1))
    with pytest.raises(TypeError):
        draft.attach_target(object())


def test_unattached_draft_says_what_to_do():
    draft = PosSDraftModel(PosSDraftConfig.for_target(tiny_llama().config))
    with pytest.raises(RuntimeError, match="attach_target"):
        draft(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 64))


# ------------------------------------------------------------------ forward / cache
def test_forward_with_cache_equals_full_forward():
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2)
    ids, feats = torch.randint(0, 128, (1, 10)), torch.randn(1, 10, 64)
    with torch.no_grad():
        full = draft(ids, feats, specialist=1).last_hidden_state
        cache = PosSDraftCache(2)
        first = draft(ids[:, :6], feats[:, :6], specialist=1, cache=cache).last_hidden_state
        second = draft(ids[:, 6:], feats[:, 6:], specialist=1, cache=cache).last_hidden_state
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length(1) == 10 and cache.get_seq_length(0) == 0


def test_specialists_differ_and_index_is_checked():
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2)
    ids, feats = torch.randint(0, 128, (1, 5)), torch.randn(1, 5, 64)
    with torch.no_grad():
        a = draft(ids, feats, specialist=0).last_hidden_state
        b = draft(ids, feats, specialist=1).last_hidden_state
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="specialist"):
        draft(ids, feats, specialist=2)


def test_padding_mask_matches_unpadded_rows():
    target = tiny_llama()
    draft = tiny_draft(target)
    ids, feats = torch.randint(0, 128, (1, 6)), torch.randn(1, 6, 64)
    padded_ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    padded_feats = torch.cat([torch.zeros(1, 2, 64), feats], 1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        ref = draft(ids, feats).last_hidden_state
        out = draft(padded_ids, padded_feats, attention_mask=mask, position_ids=positions).last_hidden_state
    torch.testing.assert_close(out[:, 2:], ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ drafting
def test_tree_shape_and_invariants():
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=3, positions_per_specialist=2)
    ids, feats = torch.randint(0, 128, (1, 9)), torch.randn(1, 8, 64)
    with torch.no_grad():
        tree = draft.draft_tree(ids, feats, depth=5, top_k=4, total_tokens=20)
    assert tree.num_nodes == 20 and int(tree.tokens[0]) == int(ids[0, -1])
    assert tree.parents[0] == -1 and bool((tree.parents[1:] < torch.arange(1, 20)).all())
    assert bool((tree.depths[1:] == tree.depths[tree.parents[1:]] + 1).all())
    assert tree.max_depth <= 5
    # scores never increase from parent to child, and siblings carry distinct tokens
    assert bool((tree.scores[1:] <= tree.scores[tree.parents[1:]] + 1e-6).all())
    pairs = {(int(p), int(t)) for p, t in zip(tree.parents[1:], tree.tokens[1:])}
    assert len(pairs) == 19
    # ancestor mask agrees with parents
    for i in range(1, 20):
        assert bool(tree.tree_mask[i, tree.parents[i]]) and bool(tree.tree_mask[i, i])


def test_incremental_proposer_equals_fresh_drafting():
    """Reusing each specialist's cache across rounds gives the same tree as drafting from scratch."""
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=3, positions_per_specialist=1)
    ids, feats = torch.randint(0, 128, (1, 14)), torch.randn(1, 13, 64)
    with torch.no_grad():
        proposer = PosSProposer(draft, depth=4, top_k=3, total_tokens=12)
        proposer.propose(ids[:, 1:8], feats[:, :7])
        proposer.propose(ids[:, 8:11], feats[:, 7:10])
        incremental = proposer.propose(ids[:, 11:], feats[:, 10:])
        fresh = draft.draft_tree(ids, feats, depth=4, top_k=3, total_tokens=12)
    assert incremental.paths() == fresh.paths()
    torch.testing.assert_close(incremental.scores, fresh.scores, rtol=1e-5, atol=1e-5)


def test_chain_drafting_matches_sequential_forward():
    """With top_k = 1 the tree is a chain; each step equals a plain forward of the right specialist."""
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1)
    ids, feats = torch.randint(0, 128, (1, 7)), torch.randn(1, 6, 64)
    with torch.no_grad():
        tree = draft.draft_tree(ids, feats, depth=3, top_k=1, total_tokens=4)
        # sequential: specialist 0 over the context, then specialist 1 over context + drafted pairs
        out0 = draft(ids[:, 1:], feats, specialist=0).last_hidden_state[:, -1]
        t1 = draft.compute_logits(out0).argmax(-1)
        ids1 = torch.cat([ids[:, 1:], t1[:, None]], 1)
        feats1 = torch.cat([feats, out0[:, None]], 1)
        out1 = draft(ids1, feats1, specialist=1).last_hidden_state[:, -1]
        t2 = draft.compute_logits(out1).argmax(-1)
        ids2 = torch.cat([ids1, t2[:, None]], 1)
        feats2 = torch.cat([feats1, out1[:, None]], 1)
        t3 = draft.compute_logits(draft(ids2, feats2, specialist=1).last_hidden_state[:, -1]).argmax(-1)
    assert tree.tokens.tolist() == [int(ids[0, -1]), int(t1), int(t2), int(t3)]


def test_draft_vocabulary_restricts_tokens():
    target = tiny_llama()
    draft = tiny_draft(target, draft_vocab_size=16)
    with torch.no_grad():
        draft.draft_to_target.copy_(torch.arange(100, 116))
        tree = draft.draft_tree(torch.randint(0, 128, (1, 6)), torch.randn(1, 5, 64), depth=3, top_k=4, total_tokens=10)
    assert bool(((tree.tokens[1:] >= 100) & (tree.tokens[1:] < 116)).all())


# ------------------------------------------------------------------ hub round trips
def test_save_load_round_trip_and_automodel(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=3)
    draft.generation_config.tree_depth = 4
    draft.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert "model.safetensors" in files and "README.md" in files and "generation_config.json" in files
    assert not any(name.endswith(".bin") for name in files)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
    assert not any("embed" in k or "lm_head" in k for k in keys), keys
    card = (tmp_path / "README.md").read_text()
    assert "| specialists (S) | 2 |" in card and "| positions per specialist (N) | 3 |" in card
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "poss_draft"

    for loader in (PosSDraftModel.from_pretrained, AutoModel.from_pretrained):
        loaded = loader(tmp_path)
        assert isinstance(loaded, PosSDraftModel)
        for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
            torch.testing.assert_close(a, b, msg=name)
    assert PosSDraftModel.from_pretrained(tmp_path).generation_config.tree_depth == 4
    assert isinstance(AutoConfig.from_pretrained(tmp_path), PosSDraftConfig)
    loaded = PosSDraftModel.from_pretrained(tmp_path).attach_target(target)
    ids, feats = torch.randint(0, 128, (1, 5)), torch.randn(1, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, feats, specialist=1).last_hidden_state, draft(ids, feats, specialist=1).last_hidden_state)


def test_token_map_survives_round_trip(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, draft_vocab_size=8)
    with torch.no_grad():
        draft.draft_to_target.copy_(torch.tensor([3, 5, 7, 11, 13, 17, 19, 23]))
    draft.save_pretrained(tmp_path)
    loaded = PosSDraftModel.from_pretrained(tmp_path)
    assert loaded.draft_to_target.tolist() == [3, 5, 7, 11, 13, 17, 19, 23]


def test_gradient_checkpointing_switch():
    draft = tiny_draft(tiny_llama())
    assert not draft.is_gradient_checkpointing
    draft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert draft.is_gradient_checkpointing
    draft.gradient_checkpointing_disable()
    assert not draft.is_gradient_checkpointing


@pytest.mark.parametrize("heads,kv_heads,length,block", [(6, 2, 37, 8), (4, 4, 16, 16), (4, 1, 9, 128)])
def test_block_causal_attention_equals_sdpa_with_a_causal_mask(heads, kv_heads, length, block):
    import torch.nn.functional as F

    from transformers_poss.modeling_poss_layers import block_causal_attention, causal_mask

    generator = torch.Generator().manual_seed(0)
    shapes = [(2, heads, length, 8), (2, kv_heads, length, 8), (2, kv_heads, length, 8)]
    inputs = [torch.randn(*shape, dtype=torch.float64, generator=generator, requires_grad=True) for shape in shapes]
    upstream = torch.randn(2, heads, length, 8, dtype=torch.float64, generator=generator)
    mask = causal_mask(length, 0, "cpu")
    want = F.scaled_dot_product_attention(*inputs, attn_mask=mask, scale=0.3, enable_gqa=heads != kv_heads)
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)
    got = block_causal_attention(*inputs, scale=0.3, block_size=block)
    got_grads = torch.autograd.grad((got * upstream).sum(), inputs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    # a mask that lets a query see one key too many changes the output (the comparison above can fail)
    leaky = causal_mask(length, 0, "cpu").clone()
    leaky[..., 0, 1] = True
    other = F.scaled_dot_product_attention(*inputs, attn_mask=leaky, scale=0.3, enable_gqa=heads != kv_heads)
    assert not torch.allclose(other, got)


def test_layer_with_a_block_causal_mask_equals_the_bool_mask():
    from transformers_poss.modeling_poss_layers import BlockCausalMask, causal_mask

    target = tiny_llama()
    draft = tiny_draft(target).double()
    layer = draft.layers[0]
    torch.manual_seed(0)
    hidden = torch.randn(2, 21, draft.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(21)[None].expand(2, -1)
    embeddings = draft.position_embeddings(hidden, positions)
    keys, values = layer.project_kv(hidden, embeddings)
    want = layer(hidden, embeddings, keys, values, causal_mask(21, 0, "cpu"))
    got = layer(hidden, embeddings, keys, values, BlockCausalMask(block_size=5))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
