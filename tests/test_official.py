"""Loading checkpoints in the authors' layout: formats, bias, N, embeddings, bad files, conversion."""

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from helpers import tiny_llama
from transformers_poss import PosSDraftModel
from transformers_poss.cli.convert import convert_official
from transformers_poss.checkpoints.official import positions_from_name


def _official_state(target, layers=2, bias=True, same_embedding=True, seed=0):
    torch.manual_seed(seed)
    h, kv = 64, 32  # 4 heads of 16, 2 kv heads
    state = {"fc.weight": torch.randn(h, 2 * h) * 0.05}
    if bias:
        state["fc.bias"] = torch.randn(h) * 0.05
    embed = target.get_input_embeddings().weight.detach().clone()
    state["embed_tokens.weight"] = embed if same_embedding else torch.randn_like(embed)
    for i in range(layers):
        p = f"layers.{i}."
        state[p + "self_attn.q_proj.weight"] = torch.randn(h, h) * 0.05
        state[p + "self_attn.k_proj.weight"] = torch.randn(kv, h) * 0.05
        state[p + "self_attn.v_proj.weight"] = torch.randn(kv, h) * 0.05
        state[p + "self_attn.o_proj.weight"] = torch.randn(h, h) * 0.05
        state[p + "mlp.gate_proj.weight"] = torch.randn(128, h) * 0.05
        state[p + "mlp.up_proj.weight"] = torch.randn(128, h) * 0.05
        state[p + "mlp.down_proj.weight"] = torch.randn(h, 128) * 0.05
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return state


def _write(folder, state, fmt="safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=128, max_position_embeddings=512)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("bias", [True, False])
def test_load_formats_and_bias(tmp_path, fmt, bias):
    target = tiny_llama()
    state = _official_state(target, layers=3, bias=bias)
    draft = PosSDraftModel.from_official(str(_write(tmp_path / "PosS2-tiny", state, fmt)), target=target)
    assert draft.config.num_specialists == 3 and draft.config.positions_per_specialist == 2
    assert draft.config.fc_bias is bias and (draft.fc.bias is not None) is bias
    assert draft.embed_tokens is None and draft.is_attached
    torch.testing.assert_close(draft.layers[2].mlp.down_proj.weight, state["layers.2.mlp.down_proj.weight"])


def test_missing_n_is_a_clear_error_and_argument_wins(tmp_path):
    target = tiny_llama()
    folder = _write(tmp_path / "my-draft", _official_state(target, layers=2))
    with pytest.raises(ValueError, match="positions_per_specialist"):
        PosSDraftModel.from_official(str(folder), target=target)
    draft = PosSDraftModel.from_official(str(folder), target=target, positions_per_specialist=3)
    assert draft.config.training_depth == 6


def test_single_layer_eagle_checkpoint_needs_no_n(tmp_path):
    target = tiny_llama()
    draft = PosSDraftModel.from_official(str(_write(tmp_path / "EAGLE-tiny", _official_state(target, layers=1, bias=False))), target=target)
    assert draft.config.num_specialists == 1 and draft.config.fc_bias is False


def test_different_embedding_is_kept(tmp_path):
    target = tiny_llama()
    state = _official_state(target, layers=1, same_embedding=False)
    draft = PosSDraftModel.from_official(str(_write(tmp_path / "PosS1-x", state)), target=target)
    assert draft.embed_tokens is not None
    torch.testing.assert_close(draft.embed_tokens.weight, state["embed_tokens.weight"])
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(draft.embed(ids), state["embed_tokens.weight"][ids])


def test_pickled_code_in_bin_is_refused(tmp_path):
    folder = tmp_path / "PosS1-evil"
    _write(folder, _official_state(tiny_llama(), layers=1))
    (folder / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (print, ("executed",))

    with open(folder / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"fc.weight": Payload()}, fh)
    with pytest.raises(ValueError, match="plain tensors"):
        PosSDraftModel.from_official(str(folder))


def test_corrupt_safetensors_is_refused(tmp_path):
    folder = _write(tmp_path / "PosS1-bad", _official_state(tiny_llama(), layers=1))
    (folder / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        PosSDraftModel.from_official(str(folder))


def test_unexpected_keys_are_refused(tmp_path):
    target = tiny_llama()
    state = _official_state(target, layers=1)
    state["norm.weight"] = torch.ones(64)
    with pytest.raises(ValueError, match="unexpected keys"):
        PosSDraftModel.from_official(str(_write(tmp_path / "PosS1-x", state)), target=target)


def test_mismatched_target_is_refused(tmp_path):
    folder = _write(tmp_path / "PosS1-x", _official_state(tiny_llama(), layers=1))
    with pytest.raises(ValueError, match="hidden size"):
        PosSDraftModel.from_official(str(folder), target=tiny_llama(hidden_size=32, heads=2, kv_heads=1))


def test_convert_round_trip(tmp_path):
    target = tiny_llama()
    src = _write(tmp_path / "PosS2-src", _official_state(target, layers=2))
    out = convert_official(str(src), str(tmp_path / "converted"), target=target)
    converted = PosSDraftModel.from_pretrained(out).attach_target(target)
    original = PosSDraftModel.from_official(str(src), target=target)
    ids, feats = torch.randint(0, 128, (1, 6)), torch.randn(1, 6, 64)
    with torch.no_grad():
        for k in range(2):
            torch.testing.assert_close(converted(ids, feats, specialist=k).last_hidden_state, original(ids, feats, specialist=k).last_hidden_state)
    assert converted.config.positions_per_specialist == 2


def test_positions_from_name():
    assert positions_from_name("HINT-lab/PosS2-Llama3-8B-Instruct") == 2
    assert positions_from_name("/tmp/poss-3-draft") == 3
    assert positions_from_name("yuhuili/EAGLE-LLaMA3-Instruct-8B") is None
