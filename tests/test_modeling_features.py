"""Drafts that read several target layers (``feature_layers``), the EAGLE-3 layer style and an own lm_head: config
checks, the model against independent reference computations, caches, drafting, round trips; the shipped drafts."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import FEATURE_VARIANTS, randomize_norms, selected_features, tiny_draft, tiny_llama
from reference_eagle import eagle2_layer, eagle3_midlayer, rms_norm
from transformers_poss import PosSDraftCache, PosSDraftConfig, PosSDraftModel, PosSProposer
from transformers_poss.configuration_poss import eagle3_feature_layers

DRAFTS = Path(__file__).resolve().parents[1] / "drafts"


def _variant(name, target=None, **kwargs):
    target = target or tiny_llama(layers=4)
    return target, randomize_norms(tiny_draft(target, **FEATURE_VARIANTS[name], **kwargs))


# ------------------------------------------------------------------ config
def test_for_target_feature_layers_and_sizes():
    target = tiny_llama(layers=30)
    layers = eagle3_feature_layers(30)
    assert layers == [2, 15, 27]
    config = PosSDraftConfig.for_target(target.config, feature_layers=layers, layer_style="eagle3", own_lm_head=True)
    assert config.feature_layers == [2, 15, 27] and config.target_num_hidden_layers == 30
    assert (config.num_feature_layers, config.target_feature_size, config.fused_size) == (3, 192, 128)
    plain = PosSDraftConfig.for_target(target.config)
    assert plain.feature_layers is None and plain.layer_style == "eagle2" and not plain.own_lm_head
    assert (plain.target_feature_size, plain.fused_size) == (64, 64)


@pytest.mark.parametrize(
    "value, message",
    [("2", "list of target layer"), (3, "list of target layer"), ([], "non-empty list of integers"),
     ([1.0, 2], "non-empty list of integers"), ([True], "non-empty list of integers"), ([1, 1], "repeats"),
     ([-1, 2], r"\[0, 4\]"), ([2, 5], r"\[0, 4\]")],
)
def test_invalid_feature_layers_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        PosSDraftConfig.for_target(tiny_llama(layers=4).config, feature_layers=value)


def test_invalid_layer_style_is_refused():
    with pytest.raises(ValueError, match="layer_style"):
        PosSDraftConfig.for_target(tiny_llama().config, layer_style="eagle4")


def test_config_round_trip_and_old_config_without_fields(tmp_path):
    config = PosSDraftConfig.for_target(tiny_llama(layers=4).config, feature_layers=[3, 1], layer_style="eagle3",
                                        own_lm_head=True)
    config.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["feature_layers"] == [3, 1] and stored["layer_style"] == "eagle3" and stored["own_lm_head"]
    loaded = PosSDraftConfig.from_pretrained(tmp_path)
    assert loaded.feature_layers == [3, 1] and loaded.target_feature_size == 128  # order kept
    for key in ("feature_layers", "layer_style", "own_lm_head", "target_num_hidden_layers"):
        stored.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(stored))
    old = PosSDraftConfig.from_pretrained(tmp_path)
    assert old.feature_layers is None and old.layer_style == "eagle2" and not old.own_lm_head


def test_attach_refuses_feature_layers_the_target_lacks():
    draft = tiny_draft(tiny_llama(layers=4), feature_layers=[1, 4])
    with pytest.raises(ValueError, match=r"feature layer\(s\) \[4\] beyond the target's 2 layers"):
        draft.attach_target(tiny_llama(layers=2))
    with pytest.raises(ValueError, match="decoder layers != the 4"):
        draft.attach_target(tiny_llama(layers=6))


# ------------------------------------------------------------------ modules and the reference computations
def test_modules_of_each_style():
    target = tiny_llama(layers=4)
    e2 = tiny_draft(target, feature_layers=[1, 2, 4])
    assert e2.feature_fc.weight.shape == (64, 192) and e2.feature_fc.bias is None and e2.fc.weight.shape == (64, 128)
    assert e2.norm is None and e2.lm_head is None
    e3 = tiny_draft(target, feature_layers=[0, 3], layer_style="eagle3", own_lm_head=True, draft_vocab_size=16)
    assert e3.fc is None and e3.norm is not None and e3.lm_head.weight.shape == (16, 64)
    assert e3.layers[0].self_attn.q_proj.weight.shape == (64, 128) and e3.layers[0].self_attn.o_proj.weight.shape == (64, 64)
    names = set(dict(e3.named_parameters()))
    assert {"layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "norm.weight"} <= names
    assert tiny_draft(target).feature_fc is None  # default: the single post-norm feature, no fusion layer


def _layer_state(draft, specialist):
    return {k[len(f"layers.{specialist}."):]: v for k, v in draft.state_dict().items() if k.startswith(f"layers.{specialist}.")}


@pytest.mark.parametrize("name", sorted(FEATURE_VARIANTS))
def test_forward_and_logits_equal_reference(name):
    target, draft = _variant(name, num_specialists=2)
    config = draft.config
    ids = torch.randint(0, 128, (1, 9))
    feats = selected_features(target, ids, config.feature_layers)
    assert feats.shape[-1] == config.target_feature_size
    embeds = target.get_input_embeddings()(ids[:, 1:])[0].detach()
    fused = feats[0, :-1] if draft.feature_fc is None else feats[0, :-1] @ draft.feature_fc.weight.T
    shape = (config.num_attention_heads, config.num_key_value_heads, config.rope_parameters["rope_theta"], config.rms_norm_eps)
    with torch.no_grad():
        for s in range(2):
            out = draft(ids[:, 1:], feats[:, :-1], specialist=s).last_hidden_state[0]
            state = _layer_state(draft, s)
            if config.layer_style == "eagle3":
                ref = eagle3_midlayer(state, "", embeds, fused, *shape)
            else:
                ref = eagle2_layer({**state, "fc.weight": draft.fc.weight, "fc.bias": draft.fc.bias}, "", embeds, fused, *shape)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        logits = draft.compute_logits(out)
        head = draft.lm_head.weight if config.own_lm_head else target.lm_head.weight
        normed = rms_norm(out, draft.norm.weight, config.rms_norm_eps) if config.layer_style == "eagle3" else out
        torch.testing.assert_close(logits, normed @ head.T, rtol=1e-4, atol=1e-5)


def test_fuse_checks_feature_widths():
    _, draft = _variant("eagle3-fl")
    with pytest.raises(ValueError, match="this draft reads 192"):
        draft(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 64))
    with pytest.raises(ValueError, match="fuse_target_features first"):
        draft.fuse(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 192))
    assert draft.fuse_target_features(torch.zeros(1, 3, 192)).shape == (1, 3, 64)
    assert draft.fuse(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 64)).shape == (1, 3, 128)


@pytest.mark.parametrize("name", sorted(FEATURE_VARIANTS))
def test_cache_and_incremental_drafting(name):
    target, draft = _variant(name, num_specialists=3)
    ids = torch.randint(0, 128, (1, 14))
    feats = selected_features(target, ids, draft.config.feature_layers)[:, :-1]
    with torch.no_grad():
        full = draft(ids[:, 1:], feats, specialist=1).last_hidden_state
        cache = PosSDraftCache(3)
        first = draft(ids[:, 1:7], feats[:, :6], specialist=1, cache=cache).last_hidden_state
        second = draft(ids[:, 7:], feats[:, 6:], specialist=1, cache=cache).last_hidden_state
        torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-5, atol=1e-5)
        proposer = PosSProposer(draft, depth=4, top_k=3, total_tokens=12)
        proposer.propose(ids[:, 1:8], feats[:, :7])
        incremental = proposer.propose(ids[:, 8:], feats[:, 7:])
        fresh = draft.draft_tree(ids, feats, depth=4, top_k=3, total_tokens=12)
    assert incremental.paths() == fresh.paths()


@pytest.mark.parametrize("name", sorted(FEATURE_VARIANTS))
def test_chain_drafting_feeds_own_features(name):
    """top_k = 1: a chain; step 2 fuses the draft's own H-wide feature (no feature_fc), as a forward over a built pair."""
    target, draft = _variant(name, num_specialists=2)
    ids = torch.randint(0, 128, (1, 7))
    feats = selected_features(target, ids, draft.config.feature_layers)[:, :-1]
    with torch.no_grad():
        tree = draft.draft_tree(ids, feats, depth=2, top_k=1, total_tokens=3)
        out0 = draft(ids[:, 1:], feats, specialist=0).last_hidden_state[:, -1]
        t1 = draft.to_target_tokens(draft.compute_logits(out0).argmax(-1))
        layer, hidden = draft.layers[1], draft.fuse(ids[:, 1:], draft.fuse_target_features(feats))
        pair = draft.fuse(t1[:, None], out0[:, None])
        rows = torch.cat([hidden, pair], 1)
        emb = draft.position_embeddings(rows, torch.arange(7)[None])
        keys, values = layer.project_kv(rows, emb)
        out1 = layer(rows, emb, keys, values, torch.ones(1, 1, 7, 7, dtype=torch.bool).tril())[:, -1]
        t2 = draft.to_target_tokens(draft.compute_logits(out1).argmax(-1))
    assert tree.tokens.tolist() == [int(ids[0, -1]), int(t1), int(t2)]


def test_own_head_with_draft_vocabulary_maps_tokens():
    target, draft = _variant("eagle3-fl-head", draft_vocab_size=16)
    with torch.no_grad():
        draft.draft_to_target.copy_(torch.arange(100, 116))
        ids = torch.randint(0, 128, (1, 6))
        tree = draft.draft_tree(ids, selected_features(target, ids, [0, 3])[:, :-1], depth=3, top_k=4, total_tokens=10)
    assert bool(((tree.tokens[1:] >= 100) & (tree.tokens[1:] < 116)).all())
    from transformers_poss.vocab import set_token_map

    with pytest.raises(ValueError, match="its own lm_head"):
        set_token_map(draft, torch.arange(8))


@pytest.mark.parametrize("name", sorted(FEATURE_VARIANTS))
def test_save_load_round_trip(tmp_path, name):
    target, draft = _variant(name, num_specialists=2)
    draft.save_pretrained(tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert ("lm_head.weight" in keys) == draft.config.own_lm_head
    assert ("feature_fc.weight" in keys) == (draft.config.feature_layers is not None)
    loaded = PosSDraftModel.from_pretrained(tmp_path).attach_target(target)
    assert loaded.config.layer_style == draft.config.layer_style
    ids = torch.randint(0, 128, (1, 6))
    feats = selected_features(target, ids, draft.config.feature_layers)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, feats, specialist=1).last_hidden_state,
                                   draft(ids, feats, specialist=1).last_hidden_state)


# ------------------------------------------------------------------ the shipped (EAGLE-2 format) drafts
@pytest.mark.integration
@pytest.mark.parametrize("name", ["eagle2-smollm2-135m-instruct", "poss-smollm2-135m-instruct"])
def test_shipped_drafts_load_unchanged(name):
    from transformers_poss.embedded import load_target

    target, tokenizer = load_target("smollm2-135m-instruct")
    draft = PosSDraftModel.from_pretrained(DRAFTS / name).float().attach_target(target)
    config = draft.config
    assert config.feature_layers is None and config.layer_style == "eagle2" and not config.own_lm_head
    assert draft.feature_fc is None and draft.norm is None and draft.lm_head is None
    raw = {k: v.float() for k, v in load_file(str(DRAFTS / name / "model.safetensors")).items()}
    ids = tokenizer("Speculative decoding drafts a tree of tokens", return_tensors="pt").input_ids
    with torch.no_grad():
        feats = target.model(ids).last_hidden_state
        embeds = target.get_input_embeddings()(ids[:, 1:])[0]
        shape = (config.num_attention_heads, config.num_key_value_heads, config.rope_parameters["rope_theta"],
                 config.rms_norm_eps)
        for s in range(config.num_specialists):
            out = draft(ids[:, 1:], feats[:, :-1], specialist=s).last_hidden_state[0]
            ref = eagle2_layer(raw, f"layers.{s}.", embeds, feats[0, :-1], *shape)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
