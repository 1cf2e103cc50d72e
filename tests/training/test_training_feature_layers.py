"""Training drafts that read several target layers (EAGLE-3 style): multi-layer features online and in shards, layout
checks, EAGLE-3's token-only objective, starting from a trained draft and the warm start from an EAGLE-2 draft."""

import json

import pytest
import torch

from helpers import FEATURE_VARIANTS, motif_sequences, randomize_norms, selected_features, tiny_draft, tiny_llama
from transformers_poss.training.features import (FeatureShardDataset, PosSDataCollator, TargetFeatures,
                                                 write_feature_shards)
from transformers_poss.training.objective import EAGLE3_OBJECTIVE, ObjectiveConfig, soft_label_logits, step_loss_weights
from transformers_poss.training.trainer import PosSTrainer, PosSTrainingArguments
from transformers_poss.training.warm_start import feature_pairs, fit_feature_fc, init_specialists
from transformers_poss.vocab import set_token_map

LAYERS = 4  # tiny_llama(layers=4): hidden_states indices 0..4, 4 = post-norm


def _args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=3e-3,
                    num_train_epochs=1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                    dataloader_num_workers=0, seed=0, disable_tqdm=True, warmup_steps=0, max_grad_value=None)
    defaults.update(kwargs)
    return PosSTrainingArguments(**defaults)


def _post_norm(target, ids):
    with torch.no_grad():
        return target.get_decoder()(input_ids=ids).last_hidden_state


# ---------------------------------------------------------------------------------------------------- features
@pytest.mark.parametrize("layers", [[1, 2, 4], [0, 3]])
def test_multi_layer_features_online_and_in_shards(tmp_path, layers):
    """Shards store the k layers `[T, k*H]` and the post-norm feature (its own tensor, or the slot of layer 4)."""
    target = tiny_llama(layers=LAYERS)
    data = motif_sequences(6)
    index = write_feature_shards(target, data, tmp_path, batch_size=4, sequences_per_shard=4, dtype=torch.float32,
                                 progress=False, feature_layers=layers)
    assert index["feature_layers"] == layers and index["feature_size"] == 64 * len(layers)
    assert index["last_hidden_state"] == ({"slot": 2} if 4 in layers else "stored")
    stored = FeatureShardDataset(tmp_path, feature_layers=layers)
    assert stored.feature_layers == layers and len(stored) == 6
    from safetensors import safe_open

    with safe_open(str(tmp_path / "shard-00000.safetensors"), framework="pt") as handle:
        assert ("last_hidden_state" in handle.keys()) == (4 not in layers)  # no second copy of a selected layer
        assert json.loads(handle.metadata()["feature_layers"]) == layers
    for i in (0, 5):
        ids = torch.as_tensor(data[i]["input_ids"])[None]
        item = stored[i]
        assert item["hidden_states"].shape == (ids.shape[1], 64 * len(layers))
        expected = selected_features(target, ids, layers)[0]
        torch.testing.assert_close(item["hidden_states"], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["last_hidden_state"], _post_norm(target, ids)[0], rtol=1e-5, atol=1e-5)
    # online: the same features and post-norm features
    batch = PosSDataCollator()(data[:3])
    online = TargetFeatures(target, layers).draft_inputs(batch["tokens"], batch["loss_mask"], batch["attention_mask"])
    offline = PosSDataCollator()([stored[i] for i in range(3)])
    assert set(online) == set(offline) == {"input_ids", "target_hidden_states", "target_last_hidden_state", "loss_mask"}
    real = batch["attention_mask"].bool()  # padded positions: zeros offline, computed online
    for key in ("target_hidden_states", "target_last_hidden_state"):
        torch.testing.assert_close(offline[key][real], online[key][real], rtol=1e-5, atol=1e-5)
    draft = tiny_draft(target, feature_layers=layers, num_specialists=2)
    trainer = PosSTrainer(model=draft, args=_args(tmp_path), target=target)
    torch.testing.assert_close(trainer.compute_loss(draft.eval(), offline), trainer.compute_loss(draft, batch))


@pytest.mark.parametrize("stored, wanted", [([1, 2, 3], [3, 1]), ([1, 2, 3], [1, 2, 4]), ([0, 4, 2], [4, 2])])
def test_shards_serve_a_view_of_their_layers(tmp_path, stored, wanted):
    """A draft reading some of the stored layers (any order, the post-norm layer 4 too when it is stored, as its own
    tensor or a slot) reads a view of the same folder: the features it would have computed itself."""
    target = tiny_llama(layers=LAYERS)
    data = motif_sequences(5)
    write_feature_shards(target, data, tmp_path, batch_size=4, sequences_per_shard=3, dtype=torch.float32,
                         progress=False, feature_layers=stored)
    folder = FeatureShardDataset(tmp_path)
    assert folder.can_serve(wanted, LAYERS) and not folder.can_serve(wanted + [wanted[0]], LAYERS)
    if 4 in wanted and 4 not in stored:  # the post-norm layer is only known with the target's layer count
        assert not folder.can_serve(wanted)
    view = FeatureShardDataset(tmp_path, feature_layers=wanted, num_hidden_layers=LAYERS)
    assert view.feature_layers == wanted and view.stored_layers == stored
    for i in (0, 4):
        ids = torch.as_tensor(data[i]["input_ids"])[None]
        torch.testing.assert_close(view[i]["hidden_states"], selected_features(target, ids, wanted)[0],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(view[i]["last_hidden_state"], _post_norm(target, ids)[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(view.token_ids(i), torch.as_tensor(data[i]["input_ids"]).long())
    draft = tiny_draft(target, feature_layers=wanted)
    trainer = PosSTrainer(model=draft, args=_args(tmp_path), target=target, train_dataset=view)
    batch = PosSDataCollator()([view[i] for i in range(3)])
    assert torch.isfinite(trainer.compute_loss(draft, batch))
    with pytest.raises(ValueError, match=r"this draft reads feature_layers=\[0, 3\]"):
        FeatureShardDataset(tmp_path, feature_layers=[0, 3], num_hidden_layers=LAYERS)


@pytest.mark.parametrize("stored", [[1, 2], [0, 4]])
def test_single_feature_drafts_read_the_post_norm_feature_of_multi_layer_shards(tmp_path, stored):
    target = tiny_llama(layers=LAYERS)
    data = motif_sequences(4)
    write_feature_shards(target, data, tmp_path, batch_size=4, dtype=torch.float32, progress=False,
                         feature_layers=stored)
    view = FeatureShardDataset(tmp_path, feature_layers=None)
    assert view.feature_layers is None and view.stored_layers == stored
    ids = torch.as_tensor(data[2]["input_ids"])[None]
    assert set(view[2]) == {"input_ids", "assistant_mask", "hidden_states"}
    torch.testing.assert_close(view[2]["hidden_states"], _post_norm(target, ids)[0], rtol=1e-5, atol=1e-5)
    draft = tiny_draft(target)
    trainer = PosSTrainer(model=draft, args=_args(tmp_path), target=target, train_dataset=view)
    assert torch.isfinite(trainer.compute_loss(draft, PosSDataCollator()([view[0], view[1]])))


def test_mismatched_features_are_refused(tmp_path):
    target = tiny_llama(layers=LAYERS)
    data = motif_sequences(4)
    write_feature_shards(target, data, tmp_path / "e3", progress=False, feature_layers=[1, 2, 4])
    write_feature_shards(target, data, tmp_path / "plain", progress=False)
    with pytest.raises(ValueError, match=r"hold the post-norm feature only .*, but this draft reads feature_layers"):
        FeatureShardDataset(tmp_path / "plain", feature_layers=[1, 2, 4], num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match="write these features into another folder"):
        write_feature_shards(target, data, tmp_path / "e3", progress=False, feature_layers=[0, 3])
    with pytest.raises(ValueError, match="another folder"):
        write_feature_shards(target, data, tmp_path / "plain", progress=False, feature_layers=[0, 3])
    other = tiny_draft(target, feature_layers=[0, 3])
    with pytest.raises(ValueError, match=r"this draft reads feature_layers=\[0, 3\]"):
        PosSTrainer(model=other, args=_args(tmp_path), train_dataset=FeatureShardDataset(tmp_path / "e3"))
    with pytest.raises(ValueError, match=r"192 wide, but this draft reads feature_layers=\[0, 3\]"):
        other(**PosSDataCollator()([FeatureShardDataset(tmp_path / "e3")[0]]))
    with pytest.raises(ValueError, match="needs `target_last_hidden_state`"):
        other(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, 128), loss_mask=torch.ones(1, 5))
    # shards written before feature layers existed (no "feature_layers" in their index) read as post-norm features
    index = json.loads((tmp_path / "plain" / "features.json").read_text())
    index.pop("feature_layers")
    (tmp_path / "plain" / "features.json").write_text(json.dumps(index))
    old = FeatureShardDataset(tmp_path / "plain", feature_layers=None)
    assert old.feature_layers is None and "last_hidden_state" not in old[0]
    plain = tiny_draft(target)
    assert plain(**PosSDataCollator()([old[0], old[1]])).loss > 0
    with pytest.raises(ValueError, match="the post-norm feature only"):
        PosSTrainer(model=other, args=_args(tmp_path), train_dataset=old)


# ---------------------------------------------------------------------------------------------------- objective
def test_eagle3_objective_is_the_token_loss_with_geometric_step_weights():
    target = tiny_llama(layers=LAYERS)
    draft = tiny_draft(target, feature_layers=[0, 3], num_specialists=1, positions_per_specialist=3)
    batch = PosSDataCollator()([{**item, "hidden_states": selected_features(target, item["input_ids"][None], [0, 3])[0],
                                 "last_hidden_state": _post_norm(target, item["input_ids"][None])[0]}
                                for item in motif_sequences(3)])
    objective = ObjectiveConfig(**EAGLE3_OBJECTIVE, noise="none")
    assert step_loss_weights(objective, 3) == pytest.approx([1.0, 0.8, 0.64])
    out = draft(**batch, objective=objective)
    expected = sum(0.8 ** k * out.metrics[f"ce_{k + 1}"] for k in range(3))
    torch.testing.assert_close(out.loss, expected)
    assert all(float(out.metrics[f"feature_loss_{d}"]) == 0 for d in (1, 2, 3))  # not computed
    with_regression = draft(**batch, objective=ObjectiveConfig(**{**EAGLE3_OBJECTIVE, "feature_weight": 1.0},
                                                               noise="none"))
    assert float(with_regression.metrics["feature_loss_1"]) > 0  # the post-norm feature is the regression target
    with pytest.raises(ValueError, match="nothing would be trained"):
        ObjectiveConfig(feature_weight=0, ce_weight=0)
    with pytest.raises(ValueError, match="step_weight_decay"):
        ObjectiveConfig(step_weight_decay=0)


def _divergence(draft, target, data) -> float:
    """Sum over the unrolled steps of KL(target || draft) on ``data`` (the token loss minus the labels' entropy)."""
    batch = PosSDataCollator()(data)
    inputs = TargetFeatures(target, draft.config.feature_layers).draft_inputs(batch["tokens"], batch["loss_mask"],
                                                                              batch["attention_mask"])
    was_training = draft.training
    with torch.no_grad():
        out = draft.eval()(**inputs)
        labels = torch.softmax(soft_label_logits(draft, inputs["target_last_hidden_state"][:, 1:]).float(), -1)
        entropy = -(labels * labels.clamp_min(1e-30).log()).sum(-1)  # [B, T - 1]: of pair t's label
    draft.train(was_training)
    total, mask = 0.0, inputs["loss_mask"].bool()[:, :-1]
    for k in range(draft.config.training_depth):
        mask[:, :k] = False  # step k trains positions t >= k
        total += float(out.metrics[f"ce_{k + 1}"]) - float(entropy[mask].mean())
    return total


@pytest.mark.parametrize("variant", ["eagle2-fl", "eagle3-fl"])
def test_token_only_loss_trains_a_feature_layers_draft(tmp_path, variant):
    """EAGLE-3's objective alone (no feature regression) brings the draft's distribution to the target's."""
    target = tiny_llama(layers=LAYERS)
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # a random tiny target is nearly uniform; sharpen its next-token distribution
    draft = randomize_norms(tiny_draft(target, num_specialists=1, positions_per_specialist=3,
                                       **FEATURE_VARIANTS[variant])).train()
    data = motif_sequences(16)
    before = _divergence(draft, target, data)
    args = _args(tmp_path, num_train_epochs=4, learning_rate=2e-2, **EAGLE3_OBJECTIVE)
    trainer = PosSTrainer(model=draft, args=args, target=target, train_dataset=data)
    trainer.train()
    assert _divergence(draft, target, data) < 0.7 * before
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 16 and sum(losses[-4:]) < sum(losses[:4])


def test_soft_labels_are_the_targets_lm_head():
    """An eagle3-style draft (final norm, own lm_head) still learns the TARGET's distribution."""
    target = tiny_llama(layers=LAYERS)
    for name in ("eagle3-fl", "eagle3-fl-head"):
        draft = randomize_norms(tiny_draft(target, **FEATURE_VARIANTS[name]))
        features = torch.randn(5, 64)
        with torch.no_grad():
            torch.testing.assert_close(soft_label_logits(draft, features), target.lm_head(features))
            torch.testing.assert_close(draft.target_logits(features), target.lm_head(features))
            assert not torch.allclose(draft.compute_logits(features), target.lm_head(features))
            if draft.lm_head is None:  # a reduced drafting vocabulary: the target head's rows
                rows = torch.tensor([5, 0, 17, 3])
                set_token_map(draft, rows)
                torch.testing.assert_close(draft.target_logits(features), target.lm_head(features)[:, rows])
    from transformers_poss import PosSDraftModel

    with pytest.raises(RuntimeError, match="Training needs the target attached"):
        soft_label_logits(PosSDraftModel(draft.config), features)


# ---------------------------------------------------------------------------------------------------- init
@pytest.mark.parametrize("variant", ["eagle2-fl", "eagle3-fl"])
def test_init_from_a_one_specialist_feature_layers_draft(tmp_path, variant):
    target = tiny_llama(layers=LAYERS)
    source = randomize_norms(tiny_draft(target, num_specialists=1, seed=7, **FEATURE_VARIANTS[variant]))
    set_token_map(source, torch.arange(10, 60))
    source.save_pretrained(tmp_path / "source")
    poss = init_specialists(tiny_draft(target, num_specialists=3, positions_per_specialist=2,
                                       **FEATURE_VARIANTS[variant]), str(tmp_path / "source"))
    theirs = source.state_dict()
    for key, value in poss.state_dict().items():
        reference = theirs[key] if not key.startswith("layers.") else theirs["layers.0." + key.split(".", 2)[2]]
        torch.testing.assert_close(value, reference, msg=key)  # specialists, feature_fc, fc / norms, token map
    ids = torch.randint(0, 128, (1, 8))
    feats = selected_features(target, ids, [1, 2, 4])
    with torch.no_grad():
        for s in range(3):
            torch.testing.assert_close(poss(ids, feats, specialist=s).last_hidden_state,
                                       source(ids, feats, specialist=0).last_hidden_state)


def test_warm_start_from_an_eagle2_draft(tmp_path):
    """Identity on the highest layer's slot: with the post-norm layer selected, the step-1 output is the source's."""
    target = tiny_llama(layers=LAYERS)
    eagle = tiny_draft(target, num_specialists=1, seed=7)
    set_token_map(eagle, torch.arange(5, 69))
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        reference = eagle(ids, _post_norm(target, ids)).last_hidden_state
        warm = init_specialists(tiny_draft(target, num_specialists=3, feature_layers=[1, 4, 2]), eagle)
        assert torch.equal(warm.draft_to_target, eagle.draft_to_target) and torch.equal(warm.fc.weight, eagle.fc.weight)
        for s in range(3):
            out = warm(ids, selected_features(target, ids, [1, 4, 2]), specialist=s).last_hidden_state
            torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
        # without the post-norm layer: the fused feature is the highest selected hidden state
        below = init_specialists(tiny_draft(target, feature_layers=[0, 3]), eagle)
        feats = selected_features(target, ids, [0, 3])
        torch.testing.assert_close(below.fuse_target_features(feats), feats[..., 64:])


def test_fitted_warm_start(tmp_path):
    """feature_fc fitted by least squares: exact with the post-norm layer selected, else the best linear stand-in."""
    target = tiny_llama(layers=LAYERS)
    eagle = tiny_draft(target, num_specialists=1, seed=7)
    data = motif_sequences(12)
    write_feature_shards(target, data, tmp_path / "with", progress=False, dtype=torch.float32, feature_layers=[1, 4])
    write_feature_shards(target, data, tmp_path / "without", progress=False, dtype=torch.float32,
                         feature_layers=[0, 3])
    with_post = init_specialists(tiny_draft(target, feature_layers=[1, 4]), eagle, feature_fc="fit")
    share = fit_feature_fc(with_post, feature_pairs(FeatureShardDataset(tmp_path / "with"), with_post), ridge=1e-10)
    assert share == pytest.approx(1.0, abs=1e-6)
    ids = torch.as_tensor(data[0]["input_ids"])[None]
    with torch.no_grad():
        torch.testing.assert_close(with_post(ids, selected_features(target, ids, [1, 4])).last_hidden_state,
                                   eagle(ids, _post_norm(target, ids)).last_hidden_state, rtol=1e-4, atol=1e-4)
    fitted = init_specialists(tiny_draft(target, feature_layers=[0, 3]), eagle, feature_fc="fit")
    share = fit_feature_fc(fitted, feature_pairs(FeatureShardDataset(tmp_path / "without"), fitted))
    identity = init_specialists(tiny_draft(target, feature_layers=[0, 3]), eagle)
    assert 0 < share < 1
    # online rows (the target computes them) give the same fit as the stored ones
    online = init_specialists(tiny_draft(target, feature_layers=[0, 3]), eagle, feature_fc="fit")
    assert fit_feature_fc(online, feature_pairs(data, online, target)) == pytest.approx(share, rel=1e-6)
    torch.testing.assert_close(online.feature_fc.weight, fitted.feature_fc.weight, rtol=1e-4, atol=1e-5)
    feats, post = selected_features(target, ids, [0, 3]), _post_norm(target, ids)
    with torch.no_grad():
        error = lambda draft: float((draft.fuse_target_features(feats) - post).pow(2).mean())  # noqa: E731
        assert error(fitted) < error(identity)


def test_a_wider_mlp_starts_as_the_source_and_trains_its_new_units(tmp_path):
    """intermediate_size above the source's: the same outputs at step 0, and the new units move once trained."""
    target = tiny_llama(layers=LAYERS)
    eagle = randomize_norms(tiny_draft(target, num_specialists=1, seed=7))
    set_token_map(eagle, torch.arange(5, 69))
    narrow = eagle.config.intermediate_size
    wide = init_specialists(tiny_draft(target, num_specialists=2, positions_per_specialist=1,
                                       intermediate_size=3 * narrow, seed=3), eagle)
    down = wide.layers[1].mlp.down_proj.weight
    assert down.shape[1] == 3 * narrow and not down[:, narrow:].any()
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        for s in range(2):
            torch.testing.assert_close(wide(ids, _post_norm(target, ids), specialist=s).last_hidden_state,
                                       eagle(ids, _post_norm(target, ids), specialist=0).last_hidden_state)
    new_rows = wide.layers[0].mlp.up_proj.weight[narrow:].clone()
    PosSTrainer(model=wide, args=_args(tmp_path, max_steps=3), target=target,
                train_dataset=motif_sequences(12)).train()
    assert wide.layers[0].mlp.down_proj.weight[:, narrow:].abs().sum() > 0
    assert not torch.equal(wide.layers[0].mlp.up_proj.weight[narrow:], new_rows)
    with pytest.raises(ValueError, match=f"intermediate_size={narrow} from a draft with intermediate_size={3 * narrow}"):
        init_specialists(tiny_draft(target), wide)


def test_incompatible_sources_are_refused():
    target = tiny_llama(layers=LAYERS)
    e3 = tiny_draft(target, num_specialists=1, feature_layers=[1, 2, 4])
    with pytest.raises(ValueError, match=r"reading feature_layers=\[0, 3\] from one reading feature_layers=\[1, 2, 4"):
        init_specialists(tiny_draft(target, feature_layers=[0, 3]), e3)
    with pytest.raises(ValueError, match="from one reading"):
        init_specialists(tiny_draft(target), e3)  # multi-layer into single-feature
    with pytest.raises(ValueError, match="'eagle3' layers from a draft with 'eagle2' layers"):
        init_specialists(tiny_draft(target, **FEATURE_VARIANTS["eagle3-fl"]), e3)
    with pytest.raises(ValueError, match="has no lm_head.weight"):
        init_specialists(tiny_draft(target, **FEATURE_VARIANTS["eagle3-fl-head"]),
                         tiny_draft(target, feature_layers=[0, 3], layer_style="eagle3"))
