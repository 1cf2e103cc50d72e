"""Training drafts with the Trainer: loss goes down, resume, online vs offline features, peft, evaluation."""

import pytest
import torch
from transformers import Trainer

from helpers import motif_sequences, tiny_draft, tiny_llama
from transformers_poss import PosSDraftModel
from transformers_poss.training.features import FeatureShardDataset, PosSDataCollator, TargetFeatures, write_feature_shards
from transformers_poss.training.trainer import PosSTrainer, PosSTrainingArguments, init_specialists


def _sequences(count=24, seed=0, vocab=128):
    return motif_sequences(count, seed, vocab)


def _args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=3e-3,
                    num_train_epochs=1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                    dataloader_num_workers=0, seed=0, disable_tqdm=True, bf16=False)
    defaults.update(kwargs)
    return PosSTrainingArguments(**defaults)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_loss_goes_down_online(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    data = _sequences(16)
    args = _args(tmp_path, num_train_epochs=4, learning_rate=2e-2, max_grad_value=None, warmup_steps=0)
    trainer = PosSTrainer(model=draft, args=args, target=target, train_dataset=data)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 16
    assert sum(losses[-4:]) / 4 < 0.85 * sum(losses[:4]) / 4
    assert "acc_2" in trainer.state.log_history[0]
    assert all(p.grad is None for p in target.parameters())  # the target stays frozen


def test_time_limit_stops_training_and_returns(tmp_path, monkeypatch):
    """`max_train_minutes` ends the run after the step that crosses the limit; train() returns normally."""
    import transformers_poss.training.callbacks as callbacks_module

    clock = iter(range(0, 10_000, 25))  # every reading is 25 s after the previous one
    monkeypatch.setattr(callbacks_module.time, "monotonic", lambda: float(next(clock)))
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    trainer = PosSTrainer(model=draft, args=_args(tmp_path, num_train_epochs=10, max_train_minutes=1.0),
                          target=target, train_dataset=_sequences(16))
    result = trainer.train()
    # started at t = 0; steps end at 25, 50, 75 s: the third crosses the 60 s limit
    assert result.global_step == 3 and trainer.state.max_steps == 40
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, callbacks_module.TimeLimitCallback))
    assert callback.stopped_at_step == 3


def test_resume_matches_uninterrupted_run(tmp_path):
    target = tiny_llama()
    data = _sequences(24)

    def run(out, max_steps, resume=None, save_steps=None):
        draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
        args = _args(tmp_path, output_dir=str(tmp_path / out), max_steps=max_steps,
                     save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
        trainer = PosSTrainer(model=draft, args=args, target=target, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return draft

    full = run("full", 6)
    run("half", 6, save_steps=3)  # leaves checkpoint-3 (and checkpoint-6)
    resumed = run("resumed", 6, resume=str(tmp_path / "half" / "checkpoint-3"))
    for key, value in _state(full).items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)
    untrained = tiny_draft(target, num_specialists=2, positions_per_specialist=1)
    assert not torch.allclose(untrained.fc.weight, full.fc.weight)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_online_and_offline_features_give_the_same_loss(tmp_path, dtype, tolerance):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=2).eval()
    data = _sequences(10)
    index = write_feature_shards(target, data, tmp_path / "shards", batch_size=3, sequences_per_shard=4,
                                 dtype=dtype, progress=False)
    assert index["num_tokens"] == sum(len(d["input_ids"]) for d in data) and len(index["shards"]) == 3
    stored = FeatureShardDataset(tmp_path / "shards")
    assert len(stored) == 10 and stored[3]["hidden_states"].dtype == dtype
    collate = PosSDataCollator()
    online = collate(data[:5])
    offline = collate([stored[i] for i in range(5)])
    features = TargetFeatures(target)(online["tokens"], online["attention_mask"])
    trainer = PosSTrainer(model=draft, args=_args(tmp_path), target=target)
    online_loss = trainer.compute_loss(draft, online)
    offline_loss = trainer.compute_loss(draft, offline)
    torch.testing.assert_close(offline_loss, online_loss, rtol=tolerance, atol=tolerance)
    assert torch.equal(offline["loss_mask"], online["loss_mask"])
    assert offline["target_hidden_states"].shape == features.shape
    # a plain Trainer trains on stored features: the draft's forward returns the loss
    plain = Trainer(model=draft.train(), args=_args(tmp_path, remove_unused_columns=False), train_dataset=stored,
                    data_collator=collate)
    assert plain.train().training_loss > 0


def test_feature_shards_resume(tmp_path):
    target = tiny_llama()
    data = _sequences(6)
    write_feature_shards(target, data, tmp_path, sequences_per_shard=3, progress=False)
    first = (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns
    (tmp_path / "shard-00001.safetensors").unlink()
    write_feature_shards(target, data, tmp_path, sequences_per_shard=3, progress=False)
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == first
    assert len(FeatureShardDataset(tmp_path)) == 6


def test_feature_shards_log_progress_where_no_bar_shows(tmp_path, caplog):
    from transformers.utils import logging as hf_logging

    target, data = tiny_llama(), _sequences(7)
    write_feature_shards(target, data, tmp_path, sequences_per_shard=3, progress=False)
    (tmp_path / "shard-00001.safetensors").unlink()
    hf_logging.disable_progress_bar()
    try:
        with caplog.at_level("INFO", logger="transformers_poss"):
            write_feature_shards(target, data, tmp_path, sequences_per_shard=3)
            lines = [r.getMessage() for r in caplog.records if r.name.endswith("features")]
            caplog.clear()
            write_feature_shards(target, data, tmp_path, sequences_per_shard=3, progress=False)
            assert not [r for r in caplog.records if r.name.endswith("features")]  # progress=False: silent
    finally:
        hf_logging.enable_progress_bar()
    # only the recomputed shard is reported, with its place, the rate and the time left
    assert len(lines) == 1 and "shard 2/3, 6/7 sequences" in lines[0], lines
    assert "tokens/s" in lines[0] and "min left" in lines[0]


def _padded_tokens(batches):
    return sum(b["input_ids"].numel() for b in batches)


def test_batches_group_by_length_from_the_shards_offsets(tmp_path, monkeypatch):
    """The default sampler batches sequences of similar lengths, reading the lengths from the shards' offsets (no
    item loaded to build it); every sequence comes once an epoch, and the batches pad less than random ones."""
    target, data = tiny_llama(), _sequences(48, seed=5)
    write_feature_shards(target, data, tmp_path / "shards", sequences_per_shard=16, progress=False)
    stored = FeatureShardDataset(tmp_path / "shards")
    assert stored.lengths == [len(item["input_ids"]) for item in data]
    draft = tiny_draft(target, num_specialists=1, positions_per_specialist=1).train()

    def loader(**kwargs):
        trainer = PosSTrainer(model=draft, args=_args(tmp_path, **kwargs), target=target, train_dataset=stored)
        return trainer.get_train_dataloader()

    reads = []
    original = FeatureShardDataset.__getitem__
    monkeypatch.setattr(FeatureShardDataset, "__getitem__", lambda self, i: reads.append(i) or original(self, i))
    grouped_loader = loader()
    order = list(grouped_loader.sampler)
    assert not reads  # the sampler was built and ran without loading a sequence
    assert sorted(order) == list(range(48))
    grouped, shuffled = list(grouped_loader), list(loader(train_sampling_strategy="random"))
    assert _padded_tokens(grouped) < 0.97 * _padded_tokens(shuffled)


def test_feature_shards_from_other_data_are_recomputed(tmp_path):
    target = tiny_llama()
    write_feature_shards(target, _sequences(2, seed=3), tmp_path, sequences_per_shard=3, progress=False)
    grown = _sequences(6)
    write_feature_shards(target, grown, tmp_path, sequences_per_shard=3, progress=False)
    stored = FeatureShardDataset(tmp_path)
    assert len(stored) == 6
    for i in range(6):
        assert torch.equal(stored[i]["input_ids"], torch.as_tensor(grown[i]["input_ids"]).long())


def test_feature_shards_under_bf16_autocast_are_close_and_kept_apart(tmp_path):
    target = tiny_llama()
    data = _sequences(4)
    write_feature_shards(target, data, tmp_path, progress=False, dtype=torch.float32)
    exact = [FeatureShardDataset(tmp_path)[i]["hidden_states"] for i in range(4)]
    shard = next(tmp_path.glob("shard-*.safetensors"))
    write_feature_shards(target, data, tmp_path, progress=False, dtype=torch.float32, autocast=True)
    fast = [FeatureShardDataset(tmp_path)[i]["hidden_states"] for i in range(4)]
    assert not all(torch.equal(a, b) for a, b in zip(exact, fast))  # recomputed, not kept from the float32 run
    for a, b in zip(exact, fast):
        assert ((a - b).norm() / a.norm()) < 0.05
    written = shard.stat().st_mtime_ns
    write_feature_shards(target, data, tmp_path, progress=False, dtype=torch.float32, autocast=True)
    assert shard.stat().st_mtime_ns == written  # same setting: resumed, nothing recomputed


def test_evaluation_reports_position_accuracy(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=3, positions_per_specialist=1)
    trainer = PosSTrainer(model=draft, args=_args(tmp_path, per_device_eval_batch_size=4), target=target,
                          eval_dataset=_sequences(8, seed=1))
    metrics = trainer.evaluate()
    for depth in (1, 2, 3):
        assert 0.0 <= metrics[f"eval_acc_{depth}"] <= 1.0
        assert 0.0 <= metrics[f"eval_accept_{depth}"] <= 1.0
    assert 1.0 <= metrics["eval_chain_tau"] <= 4.0
    assert draft.training is False


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    target = tiny_llama()
    batch = PosSDataCollator()(_sequences(4))
    grads = []
    for checkpointing in (False, True):
        draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
        trainer = PosSTrainer(model=draft, args=_args(tmp_path, activation_checkpointing=checkpointing, noise="none"),
                              target=target)
        trainer.compute_loss(draft, batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in draft.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])


def test_init_specialists_from_single_layer_draft(tmp_path):
    target = tiny_llama()
    eagle = tiny_draft(target, num_specialists=1, seed=7)
    eagle.save_pretrained(tmp_path / "eagle")
    poss = init_specialists(tiny_draft(target, num_specialists=3), str(tmp_path / "eagle"))
    for layer in poss.layers:
        torch.testing.assert_close(layer.self_attn.q_proj.weight, eagle.layers[0].self_attn.q_proj.weight)
    torch.testing.assert_close(poss.fc.weight, eagle.fc.weight)


def test_lora_on_the_draft_merges_into_a_plain_draft(tmp_path):
    peft = pytest.importorskip("peft")
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1)
    before = draft.layers[0].self_attn.q_proj.weight.clone()
    lora = peft.get_peft_model(draft, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    trainer = PosSTrainer(model=lora, args=_args(tmp_path, max_steps=3, learning_rate=1e-2), target=target,
                          train_dataset=_sequences(12))
    trainer.train()
    merged = lora.merge_and_unload()
    assert isinstance(merged, PosSDraftModel)
    assert not torch.allclose(merged.layers[0].self_attn.q_proj.weight, before)
    merged.save_pretrained(tmp_path / "merged")
    loaded = PosSDraftModel.from_pretrained(tmp_path / "merged").attach_target(target)
    ids, feats = torch.randint(0, 128, (1, 9)), torch.randn(1, 9, 64)
    torch.testing.assert_close(loaded(ids, feats, specialist=1).last_hidden_state,
                               merged.eval()(ids, feats, specialist=1).last_hidden_state)


def test_peft_target_features(tmp_path):
    peft = pytest.importorskip("peft")
    target = tiny_llama()
    tokens = torch.randint(0, 128, (2, 11))
    plain = TargetFeatures(target)(tokens)
    adapted = peft.get_peft_model(target, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with_adapter = TargetFeatures(adapted)(tokens)
    assert not torch.allclose(plain, with_adapter)
    merged = adapted.merge_and_unload()
    torch.testing.assert_close(with_adapter, merged.model(input_ids=tokens).last_hidden_state)


def test_bf16_training_step_on_cpu(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    before = draft.fc.weight.clone()
    trainer = PosSTrainer(model=draft, args=_args(tmp_path, bf16=True, max_steps=2), target=target,
                          train_dataset=_sequences(8))
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, draft.fc.weight)


@pytest.mark.parametrize("pays", [True, False])
def test_bf16_unset_follows_the_measurement_and_runs_under_autocast(tmp_path, monkeypatch, pays):
    import transformers_poss.training.objective as objective_module
    import transformers_poss.training.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "bf16_pays", lambda device: (pays, "measured"))
    args = _args(tmp_path, bf16=None, max_steps=1)
    assert args.bf16 is pays
    assert _args(tmp_path, bf16=None, fp16=False).bf16 is pays
    seen = []
    real = objective_module.training_forward

    def spy(*a, **k):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real(*a, **k)

    monkeypatch.setattr(objective_module, "training_forward", spy)
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    PosSTrainer(model=draft, args=args, target=target, train_dataset=_sequences(8)).train()
    assert seen and all(flag is pays for flag in seen)


def test_position_accuracy_callback_with_a_plain_trainer(tmp_path):
    from transformers_poss.training.trainer import PositionAccuracyCallback

    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    collate = PosSDataCollator()
    held_out = [collate(_sequences(4, seed=9))]
    callback = PositionAccuracyCallback(held_out, target=target, every_steps=2)
    features = TargetFeatures(target)
    stored = [dict(d, hidden_states=features(d["input_ids"][None])[0]) for d in _sequences(8)]
    trainer = Trainer(model=draft, args=_args(tmp_path, max_steps=4, remove_unused_columns=False),
                      train_dataset=stored, data_collator=collate, callbacks=[callback])
    trainer.train()
    assert [r["step"] for r in callback.history] == [2, 4]
    assert 0.0 <= callback.history[-1]["heldout_accept_2"] <= 1.0
    assert draft.training  # restored after each evaluation
