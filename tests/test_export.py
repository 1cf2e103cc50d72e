"""`poss export`: EAGLE checkpoints for vLLM / SGLang and custom_generate folders, checked by loading them back."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from helpers import tiny_draft, tiny_llama
from transformers_poss import PosSDraftModel
from transformers_poss.cli import main
from transformers_poss.checkpoints.export import EAGLE_TOKEN_MAP_FILE, ExportError, export_custom_generate, export_eagle

LAYER_KEYS = {f"layers.0.{part}" for part in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight")}


def _target_and_draft(seed=1, **kwargs):
    target = tiny_llama(rope_theta=50000.0)
    draft = tiny_draft(target, num_specialists=1, seed=seed, **kwargs)
    with torch.no_grad():
        draft.fc.bias.normal_()  # a non-zero fc bias: it must survive the export
    return target, draft


def test_eagle_config_and_tensors_are_what_the_engines_read(tmp_path):
    target, draft = _target_and_draft()
    export_eagle(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # vLLM wraps a plain Llama config into its EAGLEConfig (architectures -> EagleLlamaForCausalLM), SGLang maps
    # LlamaForCausalLM to LlamaForCausalLMEagle for draft models; both build num_hidden_layers decoder layers
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    text = target.config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "max_position_embeddings", "rms_norm_eps"):
        assert config[key] == getattr(text, key), key
    assert config["head_dim"] == text.hidden_size // text.num_attention_heads
    assert config["rope_theta"] == 50000.0 and config["rope_scaling"] is None
    assert config["tie_word_embeddings"] is False and config["eagle_fc_bias"] is True
    assert "bias" not in config  # vLLM's Llama layer reads `bias` as an attention bias
    assert config["torch_dtype"] == "float32"
    llama = LlamaConfig.from_pretrained(tmp_path)  # what the engines' config loaders see
    assert llama.num_hidden_layers == 1 and llama.head_dim == config["head_dim"]

    state = load_file(tmp_path / "model.safetensors")
    assert set(state) == {"fc.weight", "fc.bias"} | LAYER_KEYS  # no input_layernorm, lm_head or embed_tokens
    hidden, kv = text.hidden_size, text.num_key_value_heads * config["head_dim"]
    shapes = {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,),
              "layers.0.self_attn.q_proj.weight": (hidden, hidden), "layers.0.self_attn.k_proj.weight": (kv, hidden),
              "layers.0.self_attn.v_proj.weight": (kv, hidden), "layers.0.self_attn.o_proj.weight": (hidden, hidden),
              "layers.0.mlp.gate_proj.weight": (text.intermediate_size, hidden),
              "layers.0.mlp.up_proj.weight": (text.intermediate_size, hidden),
              "layers.0.mlp.down_proj.weight": (hidden, text.intermediate_size),
              "layers.0.post_attention_layernorm.weight": (hidden,)}
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    torch.testing.assert_close(state["fc.bias"], draft.fc.bias.detach())


def test_eagle_checkpoint_computes_the_draft_as_a_llama_layer_without_input_norm(tmp_path):
    """What an engine runs: fc(cat(embed(x), f)) into a stock Llama decoder layer whose input norm is skipped."""
    target, draft = _target_and_draft()
    export_eagle(draft, tmp_path)
    config = LlamaConfig.from_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    fc = nn.Linear(2 * config.hidden_size, config.hidden_size)
    fc.load_state_dict({"weight": state["fc.weight"], "bias": state["fc.bias"]})
    layer = LlamaDecoderLayer(config, layer_idx=0)
    missing, unexpected = layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")}, strict=False)
    assert missing == ["input_layernorm.weight"] and not unexpected
    layer.input_layernorm = nn.Identity()
    rope = LlamaRotaryEmbedding(config)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    features = torch.randn(1, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(7)[None]
    with torch.no_grad():
        hidden = fc(torch.cat([target.get_input_embeddings()(ids), features], dim=-1))
        causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
        engine = layer(hidden, attention_mask=causal, position_ids=positions,
                       position_embeddings=rope(hidden, positions))
        engine = engine[0] if isinstance(engine, tuple) else engine
        ours = draft(ids, features).last_hidden_state
    torch.testing.assert_close(engine, ours, rtol=1e-5, atol=1e-5)


def test_eagle_export_reimports_with_from_official(tmp_path):
    target, draft = _target_and_draft()
    draft.generation_config.tree_top_k = 3
    export_eagle(draft, tmp_path / "eagle")
    again = PosSDraftModel.from_official(str(tmp_path / "eagle"), target=target)
    assert again.config.num_specialists == 1 and again.config.fc_bias
    ours, theirs = draft.state_dict(), again.state_dict()
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    features = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        a = draft.draft_tree(ids, features, depth=4, top_k=3, total_tokens=12)
        b = again.draft_tree(ids, features, depth=4, top_k=3, total_tokens=12)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    again.generation_config.tree_top_k = 3
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, assistant_model=again, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, plain)


def test_multi_specialist_draft_is_refused_for_the_eagle_format(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=3, positions_per_specialist=2)
    with pytest.raises(ExportError, match="same single layer for every draft position"):
        export_eagle(draft, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    # the command line says so and exits non-zero
    draft.save_pretrained(tmp_path / "poss")
    assert main(["export", str(tmp_path / "poss"), "--output", str(tmp_path / "out")]) == 2


def test_reduced_vocabulary_drafts(tmp_path):
    target, draft = _target_and_draft(draft_vocab_size=16)
    with torch.no_grad():
        draft.draft_to_target.copy_(torch.arange(100, 116))
    export_eagle(draft, tmp_path / "map")
    token_map = torch.load(tmp_path / "map" / EAGLE_TOKEN_MAP_FILE, weights_only=True)  # as SGLang reads it
    assert token_map.tolist() == list(range(100, 116))
    config = json.loads((tmp_path / "map" / "config.json").read_text())
    assert config["vocab_size"] == 128 and config["transformers_poss"]["draft_vocab_size"] == 16
    assert "draft_to_target" not in load_file(tmp_path / "map" / "model.safetensors")

    export_eagle(draft, tmp_path / "full", reduced_vocab="full")
    assert not (tmp_path / "full" / EAGLE_TOKEN_MAP_FILE).exists()
    again = PosSDraftModel.from_official(str(tmp_path / "full"), target=target)
    assert again.draft_to_target is None  # drafts over the full vocabulary, same layer
    assert torch.equal(again.layers[0].self_attn.q_proj.weight, draft.layers[0].self_attn.q_proj.weight)

    with pytest.raises(ExportError, match="reduced vocabulary of 16 tokens"):
        export_eagle(draft, tmp_path / "refused", reduced_vocab="error")


def test_fc_bias_options(tmp_path):
    target = tiny_llama()
    unbiased = tiny_draft(target, num_specialists=1, fc_bias=False)
    export_eagle(unbiased, tmp_path / "zeros")
    state = load_file(tmp_path / "zeros" / "model.safetensors")
    assert torch.equal(state["fc.bias"], torch.zeros(64))  # SGLang's and EAGLE's fc always have a bias
    export_eagle(unbiased, tmp_path / "none", fc_bias=False)
    assert "fc.bias" not in load_file(tmp_path / "none" / "model.safetensors")
    assert json.loads((tmp_path / "none" / "config.json").read_text())["eagle_fc_bias"] is False
    _, biased = _target_and_draft()
    with pytest.raises(ExportError, match="non-zero fc bias"):
        export_eagle(biased, tmp_path / "dropped", fc_bias=False)


def test_scaled_embedding_targets_are_refused(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=1)
    draft.config.target_model_type = "gemma3_text"
    with pytest.raises(ExportError, match="scales its input embeddings"):
        export_eagle(draft, tmp_path)


def test_eagle_export_from_the_command_line(tmp_path):
    target, draft = _target_and_draft()
    draft.save_pretrained(tmp_path / "draft")
    assert main(["export", str(tmp_path / "draft"), "--output", str(tmp_path / "eagle"), "--format", "eagle",
                 "--dtype", "bfloat16"]) == 0
    state = load_file(tmp_path / "eagle" / "model.safetensors")
    assert state["fc.weight"].dtype == torch.bfloat16
    assert main(["export", str(tmp_path / "draft"), "--output", str(tmp_path / "sglang"), "--engine", "sglang"]) == 0
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]  # SGLang's class for EAGLE drafts
    assert set(load_file(tmp_path / "sglang" / "model.safetensors")) == set(state)
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ------------------------------------------------------------------ custom_generate
def test_custom_generate_folder_layout(tmp_path):
    _, draft = _target_and_draft()
    export_custom_generate(draft, tmp_path / "cg", repo_id="user/poss-cg")
    files = {str(p.relative_to(tmp_path / "cg")) for p in (tmp_path / "cg").rglob("*") if p.is_file()}
    assert {"README.md", "config.json", "model.safetensors", "generation_config.json",
            "custom_generate/generate.py", "custom_generate/requirements.txt"} <= files
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "cg" / "README.md")
    assert "custom_generate" in card.data.tags
    assert 'custom_generate="user/poss-cg"' in card.text
    assert (tmp_path / "cg" / "custom_generate" / "requirements.txt").read_text().startswith("transformers-poss")
    assert "DEFAULT_DRAFT = 'user/poss-cg'" in (tmp_path / "cg" / "custom_generate" / "generate.py").read_text()
    # exporting again does not repeat the usage section
    again = PosSDraftModel.from_pretrained(tmp_path / "cg")
    export_custom_generate(again, tmp_path / "cg2", repo_id="user/poss-cg")
    assert (tmp_path / "cg2" / "README.md").read_text().count("## `custom_generate`") == 1


def test_custom_generate_folder_gives_plain_greedy_output(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=2)  # any draft, PosS included
    draft.generation_config.tree_top_k = 3
    folder = export_custom_generate(draft, tmp_path / "poss-cg")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(7))
    plain = target.generate(ids, max_new_tokens=14, do_sample=False)
    out = target.generate(ids, custom_generate=str(folder), trust_remote_code=True, max_new_tokens=14,
                          do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance is not None and out.acceptance.mean_acceptance_length >= 1
    # assistant_model= as a loaded draft or a folder also works
    for assistant in (draft, str(folder)):
        again = target.generate(ids, custom_generate=str(folder), trust_remote_code=True, assistant_model=assistant,
                                max_new_tokens=14, do_sample=False)
        assert torch.equal(again, plain)
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(ids, custom_generate=str(folder), max_new_tokens=2)


def test_custom_generate_works_without_importing_transformers_poss(tmp_path):
    target = tiny_llama()
    target.save_pretrained(tmp_path / "target")
    draft = tiny_draft(target, num_specialists=1)
    draft.generation_config.tree_top_k = 2
    folder = export_custom_generate(draft, tmp_path / "draft-cg")
    script = textwrap.dedent(f"""
        import sys
        import torch
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r}).eval()
        ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(8))
        plain = target.generate(ids, max_new_tokens=12, do_sample=False)
        assert "transformers_poss" not in sys.modules
        out = target.generate(ids, custom_generate={str(folder)!r}, trust_remote_code=True, max_new_tokens=12,
                              do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), (out.sequences, plain)
        assert "transformers_poss" in sys.modules and out.acceptance.accepted_lengths
        print("OK", out.acceptance.mean_acceptance_length)
    """)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
    assert (Path(tmp_path) / "modules").exists()


@pytest.mark.integration
def test_shipped_eagle2_draft_exports_and_reimports_on_the_real_target(tmp_path):
    from transformers_poss.embedded import load_target

    try:
        target, tokenizer = load_target("smollm2-135m-instruct")
    except (ImportError, FileNotFoundError, OSError) as error:
        pytest.skip(f"embedded target not installed here: {error}")
    shipped = Path(__file__).resolve().parents[1] / "drafts" / "eagle2-smollm2-135m-instruct"
    draft = PosSDraftModel.from_pretrained(shipped)
    assert draft.config.num_specialists == 1 and draft.config.draft_vocab_size
    export_eagle(draft, tmp_path / "eagle")
    again = PosSDraftModel.from_official(str(tmp_path / "eagle"), target=target)
    assert torch.equal(again.layers[0].mlp.down_proj.weight.float(), draft.layers[0].mlp.down_proj.weight.float())
    assert torch.load(tmp_path / "eagle" / EAGLE_TOKEN_MAP_FILE, weights_only=True).tolist() == \
        draft.draft_to_target.tolist()
    again.generation_config.tree_depth, again.generation_config.tree_top_k = 4, 4
    again.generation_config.tree_total_tokens = 12
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=again, max_new_tokens=16, do_sample=False), plain)
    folder = export_custom_generate(draft, tmp_path / "cg")
    out = target.generate(ids, custom_generate=str(folder), trust_remote_code=True, max_new_tokens=16,
                          do_sample=False)
    assert torch.equal(out, plain)
