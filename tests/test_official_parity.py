"""Parity with the authors' draft code on the reference fixtures."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from transformers_poss import PosSDraftModel

CASES = ["eagle2_1layer", "poss1_4layers", "poss2_2layers"]


def _load_case(fixtures_dir, name):
    meta = json.loads((fixtures_dir / f"{name}.json").read_text())
    tensors = load_file(str(fixtures_dir / f"{name}.safetensors"))
    return meta, tensors


def _official_folder(tmp_path, meta, tensors, with_bias=True):
    folder = tmp_path / f"PosS{meta['positions_per_specialist']}-case"
    folder.mkdir()
    state = {k[len("draft."):]: v.contiguous() for k, v in tensors.items() if k.startswith("draft.")}
    if not with_bias:
        state.pop("fc.bias", None)
    save_file(state, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": meta["hidden_size"],
        "intermediate_size": meta["intermediate_size"],
        "num_attention_heads": meta["num_attention_heads"],
        "num_key_value_heads": meta["num_key_value_heads"],
        "num_hidden_layers": 1,
        "rms_norm_eps": meta["rms_norm_eps"],
        "rope_theta": meta["rope_theta"],
        "vocab_size": meta["vocab_size"],
        "max_position_embeddings": 2048,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _fixture_target(meta, tensors):
    config = LlamaConfig(
        vocab_size=meta["vocab_size"],
        hidden_size=meta["hidden_size"],
        intermediate_size=meta["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=meta["num_attention_heads"],
        num_key_value_heads=meta["num_key_value_heads"],
        rope_theta=meta["rope_theta"],
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.get_input_embeddings().weight.copy_(tensors["draft.embed_tokens.weight"])
        target.get_output_embeddings().weight.copy_(tensors["lm_head.weight"])
    return target


def _reference_paths(tensors, meta):
    tokens = tensors["tree.draft_tokens"][0].tolist()
    retrieve = tensors["tree.retrieve_indices"].tolist()
    paths = set()
    for row in retrieve:
        nodes = [i for i in row if i >= 0]
        for end in range(2, len(nodes) + 1):
            paths.add(tuple(tokens[i] for i in nodes[1:end]))
    return paths


@pytest.mark.parametrize("name", CASES)
def test_forward_and_tree_match_official(fixtures_dir, tmp_path, name):
    meta, tensors = _load_case(fixtures_dir, name)
    target = _fixture_target(meta, tensors)
    folder = _official_folder(tmp_path, meta, tensors)
    draft = PosSDraftModel.from_official(str(folder), target=target, positions_per_specialist=meta["positions_per_specialist"])
    assert draft.config.num_specialists == meta["num_specialists"]
    assert draft.config.training_depth == meta["training_depth"]
    assert draft.embed_tokens is None, "an embedding equal to the target's must be dropped"
    assert draft.generation_config.tree_context_candidates is False  # the paper's trees: no copied candidates

    ids, features = tensors["input_ids"], tensors["features"]
    with torch.no_grad():
        for k in range(meta["num_specialists"]):
            out = draft(input_ids=ids[:, 1:], target_hidden_states=features, specialist=k).last_hidden_state
            torch.testing.assert_close(out, tensors[f"forward.layer{k}"], rtol=1e-5, atol=1e-5)

    tree_meta = meta["tree"]
    tree = draft.draft_tree(ids, features, depth=tree_meta["depth"], top_k=tree_meta["top_k"], total_tokens=tree_meta["total_tokens"])
    assert tree.num_nodes == tree_meta["total_tokens"]
    assert int(tree.tokens[0]) == int(ids[0, -1])
    assert tree.paths() == _reference_paths(tensors, meta)
    ref_depths = sorted(tensors["tree.position_ids"].tolist())
    assert sorted(tree.depths.tolist()) == ref_depths


def test_paths_helper_is_sensitive(fixtures_dir, tmp_path):
    """A tree drafted with a perturbed specialist must differ: the parity check above can fail."""
    meta, tensors = _load_case(fixtures_dir, "poss1_4layers")
    target = _fixture_target(meta, tensors)
    draft = PosSDraftModel.from_official(str(_official_folder(tmp_path, meta, tensors)), target=target)
    with torch.no_grad():
        draft.layers[2].mlp.down_proj.weight.mul_(-3.0)
    t = meta["tree"]
    tree = draft.draft_tree(tensors["input_ids"], tensors["features"], depth=t["depth"], top_k=t["top_k"], total_tokens=t["total_tokens"])
    assert tree.paths() != _reference_paths(tensors, meta)
