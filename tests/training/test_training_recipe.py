"""The paper's recipe: specialists started from a trained draft (token map kept), per-step loss weights, a slow or
frozen fc, and schedules sized to a time budget that always run to their end."""

import json

import pytest
import torch

from helpers import motif_sequences, tiny_draft, tiny_llama
from transformers_poss.training.schedule import load_schedule, steps_for_budget, time_training_steps, timing_batches
from transformers_poss.training.trainer import PosSTrainer, PosSTrainingArguments, init_specialists
from transformers_poss.vocab import set_token_map


def _sequences(count=16, seed=0, vocab=128):
    return motif_sequences(count, seed, vocab)


def _args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2,
                    num_train_epochs=1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                    dataloader_num_workers=0, seed=0, disable_tqdm=True, warmup_steps=0, max_grad_value=None)
    defaults.update(kwargs)
    return PosSTrainingArguments(**defaults)


def test_init_from_keeps_the_source_token_map(tmp_path):
    target = tiny_llama()
    eagle = tiny_draft(target, num_specialists=1, seed=7)
    token_map = torch.tensor([0, 1, 2, 5, 9, 17, 33, 64, 100, 127])
    set_token_map(eagle, token_map)
    eagle.save_pretrained(tmp_path / "eagle")
    poss = init_specialists(tiny_draft(target, num_specialists=3), str(tmp_path / "eagle"))
    assert torch.equal(poss.draft_to_target, token_map)
    assert poss.config.draft_vocab_size == 10
    keep_own = init_specialists(tiny_draft(target, num_specialists=3), str(tmp_path / "eagle"), copy_token_map=False)
    assert keep_own.draft_to_target is None


def test_init_from_refuses_a_draft_of_another_shape():
    eagle = tiny_draft(tiny_llama(hidden_size=64), num_specialists=1)
    other = tiny_draft(tiny_llama(hidden_size=32, heads=2, kv_heads=1), num_specialists=2)
    with pytest.raises(ValueError, match="hidden_size"):
        init_specialists(other, eagle)


def test_cli_build_draft_keeps_the_init_from_map(tmp_path):
    from transformers_poss.training.cli import build_draft

    target = tiny_llama()
    eagle = tiny_draft(target, num_specialists=1, seed=7)
    set_token_map(eagle, torch.arange(3, 19))
    eagle.generation_config.tree_top_k, eagle.generation_config.tree_total_tokens = 4, "auto"
    eagle.generation_config.tree_context_candidates = True
    eagle.save_pretrained(tmp_path / "eagle")
    data = _sequences(4)

    class Tok:
        all_special_ids, eos_token_id, bos_token_id, pad_token_id = [0], 0, None, 0

    from transformers_poss.training.config import parse_train_args

    config = parse_train_args(["--target", "tiny", "--num_specialists", "2", "--init_from", str(tmp_path / "eagle"),
                               "--draft_vocab_size", "16"])
    draft = build_draft(config, target, data, Tok())
    assert torch.equal(draft.draft_to_target, torch.arange(3, 19))  # not rebuilt from the new data
    tree = draft.generation_config  # it drafts as the saved draft did (not with the defaults of a new one)
    assert (tree.tree_top_k, tree.tree_total_tokens, tree.tree_context_candidates) == (4, "auto", True)
    fresh = build_draft(parse_train_args(["--target", "tiny", "--num_specialists", "2", "--draft_vocab_size", "16"]),
                        target, data, Tok()).generation_config
    assert (fresh.tree_top_k, fresh.tree_total_tokens) == (10, 60)
    config.draft.draft_vocab_size = 12
    with pytest.raises(SystemExit, match="draft_vocab_size"):
        build_draft(config, target, data, Tok())


def test_step_weights_reach_the_loss(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1)
    batch = PosSTrainer(model=draft, args=_args(tmp_path), target=target).data_collator(_sequences(4))
    losses = {}
    for weights in ([1.0, 1.0], [1.0, 0.0], [0.0, 1.0]):
        trainer = PosSTrainer(model=draft, args=_args(tmp_path, step_weights=weights, noise="none"), target=target)
        with torch.no_grad():
            out = draft(**trainer._with_features(batch))
        losses[tuple(weights)] = (float(out.loss), float(out.metrics["loss_1"]), float(out.metrics["loss_2"]))
    total, first, second = losses[(1.0, 1.0)]
    assert total == pytest.approx(first + second, rel=1e-5)
    assert losses[(1.0, 0.0)][0] == pytest.approx(first, rel=1e-5)
    assert losses[(0.0, 1.0)][0] == pytest.approx(second, rel=1e-5)
    with pytest.raises(ValueError, match="step_weights"):
        _args(tmp_path, step_weights=[1.0, -1.0])


def test_frozen_fc_stays_and_the_rest_trains(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    fc_before = draft.fc.weight.detach().clone()
    layer_before = draft.layers[1].self_attn.q_proj.weight.detach().clone()
    PosSTrainer(model=draft, args=_args(tmp_path, fc_learning_rate_scale=0.0, max_steps=3), target=target,
                train_dataset=_sequences(12)).train()
    assert torch.equal(draft.fc.weight, fc_before)
    assert not torch.equal(draft.layers[1].self_attn.q_proj.weight, layer_before)


def test_slow_fc_gets_its_own_learning_rate(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    trainer = PosSTrainer(model=draft, args=_args(tmp_path, fc_learning_rate_scale=0.1, max_steps=2), target=target,
                          train_dataset=_sequences(12))
    optimizer = trainer.create_optimizer()
    fc = {id(p) for p in draft.fc.parameters()}
    rates = {("fc" if id(p) in fc else "rest"): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert rates["fc"] == pytest.approx(0.1 * rates["rest"])
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len([p for p in draft.parameters() if p.requires_grad])
    trainer.train()  # the scheduler scales both groups; training runs


def test_steps_for_budget():
    assert steps_for_budget(2.0, 10, steps_per_epoch=1000, margin=0.0) == 300
    assert steps_for_budget(2.0, 10, steps_per_epoch=100, max_epochs=2, margin=0.0) == 200   # capped by epochs
    assert steps_for_budget(100.0, 0.1, steps_per_epoch=100) == 1                          # at least one step
    with pytest.raises(ValueError):
        steps_for_budget(0.0, 10, 100)


def test_time_training_steps_warms_every_batch_then_times_all_but_the_first(monkeypatch):
    import transformers_poss.training.schedule as schedule

    clock, calls = iter(range(100)), []
    monkeypatch.setattr(schedule.time, "perf_counter", lambda: float(next(clock)))
    seconds = time_training_steps(calls.append, ["a", "b", "c", "d"], warmup=1)
    assert calls == ["a", "b", "c", "d", "b", "c", "d"]  # an untimed pass over every batch, then the timed ones
    assert seconds == pytest.approx(1 / 3)  # two clock readings around three timed steps


def test_time_training_steps_keeps_the_rng_state():
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    seconds = time_training_steps(lambda batch: torch.rand(100), [0, 1, 2])
    assert seconds >= 0
    assert torch.equal(torch.rand(1), expected)


def test_budget_sizes_the_schedule_so_it_ends(tmp_path, monkeypatch):
    """With train_budget_minutes the run chooses max_steps from the timed batches and its learning rate decays to
    the end of the schedule; a resumed run reuses the stored choice."""
    import transformers_poss.training.schedule as schedule

    monkeypatch.setattr(schedule, "time_training_steps", lambda step, batches, warmup=1: 6.0)  # 6 s a step
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    args = _args(tmp_path, train_budget_minutes=0.5, num_train_epochs=100, lr_scheduler_type="linear")
    trainer = PosSTrainer(model=draft, args=args, target=target, train_dataset=_sequences(16))
    trainer.train()
    assert trainer.state.global_step == 4  # 30 s x 0.95 / 6 s
    rates = [log["learning_rate"] for log in trainer.state.log_history if "learning_rate" in log]
    assert rates[-1] < 0.3 * rates[0]  # the schedule ran to its end
    stored = json.loads((tmp_path / "out" / "schedule.json").read_text())
    assert stored["max_steps"] == 4 and stored["seconds_per_step"] == 6.0
    assert load_schedule(tmp_path / "out", 0.5)["max_steps"] == 4
    assert load_schedule(tmp_path / "out", 1.0) is None  # another budget is measured again

    monkeypatch.setattr(schedule, "time_training_steps", lambda *a, **k: pytest.fail("re-timed on resume"))
    again = PosSTrainer(model=tiny_draft(target, num_specialists=2, positions_per_specialist=1), target=target,
                        args=_args(tmp_path, train_budget_minutes=0.5, num_train_epochs=100), train_dataset=_sequences(16))
    again.train()
    assert again.state.global_step == 4


def test_budget_times_steps_in_the_precision_they_train_in(tmp_path, monkeypatch):
    """The timed steps run under the bf16 autocast of the training steps (accelerate applies it to the prepared
    model, which the timing does not use): timed in float32, a bf16 schedule was sized at 2.3x its step time and
    ended after 43% of its budget."""
    seen = {"timing": set(), "training": set()}
    phase = ["timing"]

    def recording(module, args):  # inside the model's forward, where accelerate's autocast applies
        if module.training:
            seen[phase[0]].add(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)

    import transformers_poss.training.schedule as schedule

    time_steps = schedule.time_training_steps

    def timed(step, batches, warmup=1):
        seconds = time_steps(step, batches, warmup)
        phase[0] = "training"
        return seconds

    monkeypatch.setattr(schedule, "time_training_steps", timed)
    target = tiny_llama()
    for bf16 in (True, False):
        for states in seen.values():
            states.clear()
        phase[0] = "timing"
        draft = tiny_draft(target, num_specialists=1, positions_per_specialist=1).train()
        draft.layers[0].register_forward_pre_hook(recording)
        out = tmp_path / str(bf16)
        trainer = PosSTrainer(model=draft, target=target, train_dataset=_sequences(8),
                              args=_args(out, train_budget_minutes=0.05, num_train_epochs=1, bf16=bf16))
        trainer.train()
        assert seen["timing"] == seen["training"] == {bf16}


def test_timing_batches_are_scaled_to_the_epochs_mean_padded_size():
    lengths = [10] * 8 + [100] * 8
    order = list(range(8, 16)) + list(range(8))  # longest first, as length-grouped batches start
    for cap, mean in ((None, (400 + 400 + 40 + 40) / 4), (50, (200 + 200 + 40 + 40) / 4)):
        torch.manual_seed(0)
        batches, scale = timing_batches(lengths, order, batch_size=4, max_length=cap)
        assert sorted(map(sorted, batches)) == [list(range(i, i + 4)) for i in (0, 4, 8, 12)]  # 4 of the 4 batches
        timed = [4 * min(cap or 1000, max(lengths[i] for i in b)) for b in batches[1:]]  # the first one warms up
        assert scale * sum(timed) / len(timed) == pytest.approx(mean)
    batches, scale = timing_batches([7] * 12, list(range(12)), batch_size=4)
    assert len(batches) == 4 and sorted(map(sorted, batches[:3])) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert scale == 1.0  # equal batches: the timed ones are the epoch's mean
    batches, scale = timing_batches([5, 9], [1, 0], batch_size=2)  # one batch: timed again after the warm-up
    assert batches == [[1, 0]] * 4 and scale == 1.0
    # many batches: drawn from the quarter nearest the mean padded size, so the factor stays near 1
    lengths = [8 * (1 + i % 64) for i in range(4096)]
    order = sorted(range(4096), key=lambda i: lengths[i])
    sizes = sorted(4 * lengths[i] for i in order[::4])
    for seed in range(5):
        torch.manual_seed(seed)
        batches, scale = timing_batches(lengths, order, batch_size=4)
        assert 0.8 < scale < 1.25
        for batch in batches:
            assert sizes[len(sizes) // 4] <= 4 * max(lengths[i] for i in batch) <= sizes[-len(sizes) // 4]


def test_budget_times_batches_of_the_whole_epoch(tmp_path, monkeypatch):
    """A dataset that knows its lengths gets its schedule from the epoch's mean padded batch, not from its first
    batches (with length-grouped batches the longest come first)."""
    import transformers_poss.training.schedule as schedule
    from transformers_poss.training.features import FeatureShardDataset, write_feature_shards

    target = tiny_llama()
    data = _sequences(12, seed=4)
    for item in data[:3]:  # the first batch: three long sequences and a short one; the two others short
        item["input_ids"], item["assistant_mask"] = item["input_ids"].repeat(4), item["assistant_mask"].repeat(4)
    write_feature_shards(target, data, tmp_path / "shards", progress=False)
    stored = FeatureShardDataset(tmp_path / "shards")
    padded = lambda batches: sum(b["loss_mask"].numel() for b in batches) / len(batches)  # noqa: E731
    monkeypatch.setattr(schedule, "time_training_steps", lambda step, batches, warmup=1: 1e-3 * padded(batches[1:]))
    draft = tiny_draft(target, num_specialists=1, positions_per_specialist=1).train()
    trainer = PosSTrainer(model=draft, target=target, train_dataset=stored,
                          args=_args(tmp_path, train_budget_minutes=10, num_train_epochs=1,
                                     train_sampling_strategy="sequential"))
    trainer.train()
    lengths = stored.lengths
    epoch_mean = sum(4 * max(lengths[i : i + 4]) for i in range(0, 12, 4)) / 3
    seconds = json.loads((tmp_path / "out" / "schedule.json").read_text())["seconds_per_step"]
    assert seconds == pytest.approx(1e-3 * epoch_mean)
    assert seconds > 1e-3 * 4 * max(lengths[4:])  # not the short batches' time (the first one only warms up)


def test_budget_is_capped_by_epochs(tmp_path, monkeypatch):
    import transformers_poss.training.schedule as schedule

    monkeypatch.setattr(schedule, "time_training_steps", lambda step, batches, warmup=1: 0.01)
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=1, positions_per_specialist=1).train()
    trainer = PosSTrainer(model=draft, args=_args(tmp_path, train_budget_minutes=10, num_train_epochs=2),
                          target=target, train_dataset=_sequences(16))
    trainer.train()
    assert trainer.state.global_step == 8  # 2 epochs of 4 batches
