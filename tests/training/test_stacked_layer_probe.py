"""examples/smollm2_drafts/stacked_layer.py: a second layer stacked on a one-step draft starts as the trained layer,
then learns."""

import pytest
import torch

from helpers import example_module, tiny_draft, tiny_llama
from transformers_poss.training.objective import ObjectiveConfig


def _batch(seed=0, length=12):
    torch.manual_seed(seed)
    return torch.randint(0, 128, (2, length)), torch.randn(2, length, 64), torch.ones(2, length)


def test_stacked_draft_starts_as_the_base_and_its_new_layer_gets_gradients():
    probe = example_module("stacked_layer")
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=1, positions_per_specialist=1)
    ids, feats, mask = _batch()
    objective = ObjectiveConfig(noise="none")
    before = draft(ids, feats, loss_mask=mask, objective=objective)
    plain = draft(ids, feats).last_hidden_state
    probe.stack_layers(draft)
    assert isinstance(draft.layers[0], probe.StackedLayer)
    torch.testing.assert_close(draft(ids, feats).last_hidden_state, plain)
    after = draft.train()(ids, feats, loss_mask=mask, objective=objective)
    torch.testing.assert_close(after.loss, before.loss)
    after.loss.backward()
    extra = draft.layers[0].extra
    assert extra.self_attn.o_proj.weight.grad.abs().sum() > 0
    assert extra.mlp.down_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():  # once its output projections move, the new layer changes the prediction
        extra.self_attn.o_proj.weight.normal_(std=0.1)
    assert not torch.allclose(draft(ids, feats).last_hidden_state, plain)


def test_stacked_probe_refuses_multi_step_drafts():
    probe = example_module("stacked_layer")
    draft = tiny_draft(tiny_llama(), num_specialists=2, positions_per_specialist=1)
    with pytest.raises(SystemExit, match="one-step eagle2 layout"):
        probe.stack_layers(draft)
