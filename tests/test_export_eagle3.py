"""`poss export` with drafts that read several target layers: the EAGLE(-2) format refuses them; one-specialist
eagle3-style drafts export to the EAGLE-3 layout, which computes the draft (checked from the raw exported tensors)
and reads back with from_official."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import FEATURE_VARIANTS, randomize_norms, selected_features, tiny_draft, tiny_llama
from reference_eagle import eagle3_logits
from transformers_poss import PosSDraftModel
from transformers_poss.cli import main
from transformers_poss.checkpoints.export import ExportError, export_eagle
from transformers_poss.checkpoints.export_eagle3 import export_eagle3


def _draft(variant="eagle3-fl-head", **kwargs):
    target = tiny_llama(layers=4)
    settings = {"num_specialists": 1, **FEATURE_VARIANTS[variant], **kwargs}
    return target, randomize_norms(tiny_draft(target, **settings))


@pytest.mark.parametrize("variant, message", [
    ("eagle2-fl", r"reads the target layers \[1, 2, 4\]"), ("eagle3-post-norm", "has EAGLE-3 style layers"),
    ("eagle3-fl-head", "has its own lm_head"),
])  # fmt: skip
def test_eagle_format_refuses_feature_and_eagle3_drafts(tmp_path, variant, message):
    _, draft = _draft(variant)
    with pytest.raises(ExportError, match=message):
        export_eagle(draft, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    draft.save_pretrained(tmp_path / "draft")
    assert main(["export", str(tmp_path / "draft"), "--output", str(tmp_path / "cli")]) == 2


@pytest.mark.parametrize("draft_vocab_size", [None, 24])
def test_eagle3_export_layout_computes_the_draft_and_reimports(tmp_path, draft_vocab_size):
    target, draft = _draft(draft_vocab_size=draft_vocab_size)
    if draft_vocab_size:
        with torch.no_grad():
            draft.draft_to_target.copy_(torch.arange(100, 124))
    export_eagle3(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 3] and config["target_hidden_size"] == 64
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 3], "use_aux_hidden_state": True}
    assert config["draft_vocab_size"] == (draft_vocab_size or 128) and config["vocab_size"] == 128
    state = load_file(tmp_path / "model.safetensors")
    assert state["fc.weight"].shape == (64, 128) and state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert not any(k.startswith("layers.") for k in state)
    mapping = torch.arange(draft_vocab_size or 128) + state["d2t"]
    assert mapping.tolist() == (list(range(100, 124)) if draft_vocab_size else list(range(128)))
    assert state["t2d"].sum() == mapping.numel() and bool(state["t2d"][mapping].all())
    # what an engine computes from the exported tensors equals the draft
    ids = torch.randint(0, 128, (1, 8))
    feats = selected_features(target, ids, [0, 3])[:, :-1]
    embeds = target.get_input_embeddings()(ids[:, 1:])[0].detach()
    reference = eagle3_logits(state, embeds, feats[0], 4, 2, draft.config.rope_parameters["rope_theta"],
                              draft.config.rms_norm_eps)  # fmt: skip
    with torch.no_grad():
        logits = draft.compute_logits(draft(ids[:, 1:], feats).last_hidden_state)[0]
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    again = PosSDraftModel.from_official(str(tmp_path), target=target)
    assert again.config.feature_layers == [0, 3] and again.config.layer_style == "eagle3"
    for name, value in draft.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name


@pytest.mark.parametrize("kwargs, message", [
    ({"num_specialists": 2}, "2 position specialists"), ({"layer_style": "eagle2"}, "eagle2-style"),
    ({"own_lm_head": False}, "borrows the target's lm_head"), ({"feature_layers": None}, "only the post-norm"),
])  # fmt: skip
def test_eagle3_export_refuses_what_the_layout_cannot_hold(tmp_path, kwargs, message):
    _, draft = _draft(**kwargs)
    with pytest.raises(ExportError, match=message):
        export_eagle3(draft, tmp_path)


def test_eagle3_export_from_the_command_line(tmp_path):
    _, draft = _draft()
    draft.save_pretrained(tmp_path / "draft")
    assert main(["export", str(tmp_path / "draft"), "--output", str(tmp_path / "e3"), "--format", "eagle3",
                 "--dtype", "bfloat16"]) == 0  # fmt: skip
    assert load_file(tmp_path / "e3" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "e3" / "config.json").read_text())["torch_dtype"] == "bfloat16"
