"""Loading released EAGLE-3 checkpoints (the SafeAILab/EAGLE / SpecForge layout): the mapping is checked against an
independent computation of the EAGLE-3 draft from the raw weights; greedy generation is lossless; what the format
cannot hold is refused."""

import json

import pytest
import torch
from safetensors.torch import save_file

from helpers import tiny_llama
from reference_eagle import eagle3_logits
from transformers_poss import PosSDraftModel
from transformers_poss.cli.convert import convert_official

H, KV, VOCAB, DRAFT_VOCAB, LAYERS = 64, 32, 128, 40, 8  # target: 4 heads of 16, 2 kv heads, 8 layers
DEFAULT_AUX = [2, 4, 5]  # EAGLE-3's [2, L // 2, L - 3] for L = 8


def _target():
    return tiny_llama(layers=LAYERS)


def _eagle3_state(target, draft_vocab=DRAFT_VOCAB, k=3, seed=0, embed="same"):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.05):
        return torch.randn(*shape, generator=generator) * scale

    state = {
        "midlayer.self_attn.q_proj.weight": rand(H, 2 * H), "midlayer.self_attn.k_proj.weight": rand(KV, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(KV, 2 * H), "midlayer.self_attn.o_proj.weight": rand(H, H),
        "midlayer.mlp.gate_proj.weight": rand(128, H), "midlayer.mlp.up_proj.weight": rand(128, H),
        "midlayer.mlp.down_proj.weight": rand(H, 128),
        "midlayer.input_layernorm.weight": 1 + rand(H, scale=0.3), "midlayer.hidden_norm.weight": 1 + rand(H, scale=0.3),
        "midlayer.post_attention_layernorm.weight": 1 + rand(H, scale=0.3),
        "fc.weight": rand(H, k * H), "norm.weight": 1 + rand(H, scale=0.3), "lm_head.weight": rand(draft_vocab, H, scale=1.0),
    }  # fmt: skip
    if draft_vocab < VOCAB:  # the draft vocabulary: a random subset of the target's, in increasing id order
        kept = torch.sort(torch.randperm(VOCAB, generator=generator)[:draft_vocab]).values
        state["d2t"] = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        state["t2d"] = t2d
    if embed == "same":
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    elif embed == "other":
        state["embed_tokens.weight"] = rand(VOCAB, H, scale=1.0)
    return state


def _write(folder, state, fmt="safetensors", **config):
    folder.mkdir(parents=True, exist_ok=True)
    values = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=H, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, rms_norm_eps=1e-6,
                  rope_theta=10000.0, vocab_size=VOCAB, draft_vocab_size=state["lm_head.weight"].shape[0],
                  max_position_embeddings=512, hidden_act="silu")  # fmt: skip
    values.update(config)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in values.items() if v is not None}))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return str(folder)


def _features(target, ids, layers):
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in layers], -1)


# ------------------------------------------------------------------ the mapping, checked against the reference
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_logits_equal_the_reference_midlayer(tmp_path, fmt):
    target = _target()
    state = _eagle3_state(target)
    draft = PosSDraftModel.from_official(_write(tmp_path / "e3", state, fmt), target=target)
    config = draft.config
    assert (config.layer_style, config.feature_layers, config.own_lm_head) == ("eagle3", DEFAULT_AUX, True)
    assert config.num_specialists == 1 and config.draft_vocab_size == DRAFT_VOCAB and draft.embed_tokens is None
    ids = torch.randint(0, VOCAB, (1, 10))
    feats = _features(target, ids, DEFAULT_AUX)
    embeds = target.get_input_embeddings()(ids[:, 1:])[0].detach()
    expected = eagle3_logits(state, embeds, feats[0, :-1], 4, 2, 10000.0, 1e-6)  # [T, V']
    with torch.no_grad():
        out = draft(ids[:, 1:], feats[:, :-1]).last_hidden_state
        logits = draft.compute_logits(out)[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # draft ids map to target ids through d2t: target id = draft id + d2t[draft id]
    best = expected.argmax(-1)
    assert draft.to_target_tokens(logits.argmax(-1)).tolist() == (best + state["d2t"][best]).tolist()


def test_greedy_identical_single_row_and_batched(tmp_path):
    target = _target()
    draft = PosSDraftModel.from_official(_write(tmp_path / "e3", _eagle3_state(target)), target=target)
    gen = draft.generation_config
    gen.tree_depth, gen.tree_top_k, gen.tree_total_tokens = 4, 4, 16
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        prompt = torch.randint(3, VOCAB, (1, 7), generator=generator)
        expected = target.generate(prompt, max_new_tokens=16, do_sample=False)
        assert target.generate(prompt, assistant_model=draft, max_new_tokens=16, do_sample=False).tolist() == expected.tolist()
    batch = torch.randint(3, VOCAB, (3, 6), generator=generator)
    expected = target.generate(batch, max_new_tokens=12, do_sample=False)
    assert target.generate(batch, assistant_model=draft, max_new_tokens=12, do_sample=False).tolist() == expected.tolist()


def test_aux_layers_from_the_config(tmp_path):
    target = _target()
    top = PosSDraftModel.from_official(_write(tmp_path / "a", _eagle3_state(target), eagle_aux_hidden_state_layer_ids=[1, 3, 7]), target=target)
    nested = PosSDraftModel.from_official(
        _write(tmp_path / "b", _eagle3_state(target, k=2), eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 8]}),
        target=target,
    )
    assert top.config.feature_layers == [1, 3, 7] and nested.config.feature_layers == [0, 8]
    without_target = PosSDraftModel.from_official(_write(tmp_path / "c", _eagle3_state(target), eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    assert without_target.config.feature_layers == [2, 4, 5] and without_target.embed_tokens is not None


def test_full_vocabulary_and_own_embedding(tmp_path):
    target = _target()
    draft = PosSDraftModel.from_official(_write(tmp_path / "e3", _eagle3_state(target, draft_vocab=VOCAB, embed="other")),
                                         target=target)  # fmt: skip
    assert draft.config.draft_vocab_size is None and draft.draft_to_target is None
    assert draft.config.own_embeddings and draft.embed_tokens is not None


def test_convert_round_trip(tmp_path):
    target = _target()
    source = _write(tmp_path / "e3", _eagle3_state(target))
    out = convert_official(source, str(tmp_path / "converted"), target=target)
    converted = PosSDraftModel.from_pretrained(out).attach_target(target)
    original = PosSDraftModel.from_official(source, target=target)
    assert converted.config.feature_layers == DEFAULT_AUX and converted.config.layer_style == "eagle3"
    ids = torch.randint(0, VOCAB, (1, 6))
    feats = _features(target, ids, DEFAULT_AUX)
    with torch.no_grad():
        torch.testing.assert_close(converted.compute_logits(converted(ids, feats).last_hidden_state),
                                   original.compute_logits(original(ids, feats).last_hidden_state))
    assert converted.draft_to_target.tolist() == original.draft_to_target.tolist()
    assert "feature layers" in (tmp_path / "converted" / "README.md").read_text().lower()


# ------------------------------------------------------------------ what cannot be represented
def _with(state, **changes):
    state = dict(state)
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            state.pop(key)
        else:
            state[key] = value
    return state


@pytest.mark.parametrize(
    "change, config, message",
    [
        ({"midlayer__self_attn__q_proj__bias": torch.zeros(H)}, {}, "unexpected keys"),
        ({"layers__0__mlp__up_proj__weight": torch.zeros(128, H)}, {}, "more than one decoder layer"),
        ({}, {"num_hidden_layers": 2}, "more than one decoder layer"),
        ({"norm__weight": None}, {}, "missing"),
        ({"something__else": torch.zeros(2)}, {}, "unexpected keys"),
        ({}, {"target_hidden_size": 128}, "target_hidden_size 128 differs"),
        ({}, {"attention_bias": True}, "attention_bias"),
        ({}, {"norm_before_residual": True}, "norm_before_residual"),
        ({}, {"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
        ({}, {"eagle_aux_hidden_state_layer_ids": [2, 4]}, "fuses 3 target hidden states"),
        ({"d2t": None}, {}, "no d2t"),
        ({"d2t": torch.full((DRAFT_VOCAB,), VOCAB)}, {}, "outside"),
        ({"t2d": torch.ones(VOCAB, dtype=torch.bool)}, {}, "t2d"),
        ({"fc__weight": torch.zeros(H, 3 * H + 1)}, {}, "fc.weight has shape"),
    ],
)
def test_what_cannot_be_represented_is_refused(tmp_path, change, config, message):
    target = _target()
    folder = _write(tmp_path / "e3", _with(_eagle3_state(target), **change), **config)
    with pytest.raises(ValueError, match=message):
        PosSDraftModel.from_official(folder, target=target)


def test_mismatched_target_and_missing_layer_ids(tmp_path):
    target = _target()
    folder = _write(tmp_path / "e3", _eagle3_state(target), eagle_aux_hidden_state_layer_ids=[2, 4, 8])
    with pytest.raises(ValueError, match=r"\[2, 4, 8\] must lie in \[0, 6\]"):
        PosSDraftModel.from_official(folder, target=tiny_llama(layers=6))
    with pytest.raises(ValueError, match="vocab size"):
        PosSDraftModel.from_official(folder, target=tiny_llama(layers=8, vocab_size=256))
    with pytest.raises(ValueError, match="pass target="):
        PosSDraftModel.from_official(_write(tmp_path / "plain", _eagle3_state(target)))


def test_poss_convert_reports_the_feature_layers(tmp_path, capsys):
    from transformers_poss.cli import main
    from tree_testing import tiny_tokenizer

    target = _target()
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    source = _write(tmp_path / "e3", _eagle3_state(target))
    assert main(["convert", source, "--output", str(tmp_path / "out"), "--target", str(tmp_path / "target")]) == 0
    assert "eagle3-style draft reading the target's feature layers [2, 4, 5]" in capsys.readouterr().out
    assert PosSDraftModel.from_pretrained(tmp_path / "out").config.feature_layers == DEFAULT_AUX
