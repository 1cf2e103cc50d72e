"""A draft in the stock transformers Trainer with its defaults, and a peft-wrapped draft as generate's assistant."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from helpers import tiny_draft, tiny_llama
from transformers_poss.training.features import PosSDataCollator, TargetFeatures


def _stored_sequences(target, count=8, seed=0, vocab=128):
    """Items as `FeatureShardDataset` yields them: input_ids, assistant_mask and the stored target features."""
    generator = torch.Generator().manual_seed(seed)
    features = TargetFeatures(target)
    items = []
    for _ in range(count):
        length = int(torch.randint(12, 20, (1,), generator=generator))
        tokens = torch.randint(3, vocab, (length,), generator=generator)
        mask = torch.zeros(length, dtype=torch.long)
        mask[length // 3 :] = 1
        items.append({"input_ids": tokens, "assistant_mask": mask, "hidden_states": features(tokens[None])[0]})
    return items


def _args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                    learning_rate=1e-3, max_steps=2, logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    defaults.update(kwargs)
    return TrainingArguments(**defaults)


def test_plain_trainer_defaults_train_and_report_eval_loss(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2).train()
    train, held_out = _stored_sequences(target, 8), _stored_sequences(target, 4, seed=1)
    args = _args(tmp_path)
    assert args.remove_unused_columns  # the stock default: the Trainer drops columns forward() does not declare
    trainer = Trainer(model=draft, args=args, train_dataset=train, eval_dataset=held_out,
                      data_collator=PosSDataCollator())
    assert trainer.train().training_loss > 0
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and metrics["eval_loss"] > 0
    # the reported loss is the draft's objective on the held-out batch
    batch = PosSDataCollator()(held_out)
    draft.eval()
    with torch.no_grad():
        expected = float(draft(**batch).loss)
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-4)


def test_plain_trainer_keeps_multi_layer_columns_of_a_datasets_dataset(tmp_path):
    """An HF `datasets.Dataset` of multi-layer features: the stock Trainer (remove_unused_columns=True) keeps the
    ``last_hidden_state`` column the token loss needs."""
    datasets = pytest.importorskip("datasets")
    target = tiny_llama(layers=4)
    draft = tiny_draft(target, feature_layers=[1, 2]).train()
    compute = TargetFeatures(target, [1, 2])
    rows = []
    for item in _stored_sequences(target, 8):
        features, last = compute.compute(item["input_ids"][None])
        rows.append({"input_ids": item["input_ids"], "assistant_mask": item["assistant_mask"],
                     "hidden_states": features[0], "last_hidden_state": last[0]})
    train = datasets.Dataset.from_list(rows).with_format("torch")
    trainer = Trainer(model=draft, args=_args(tmp_path), train_dataset=train, data_collator=PosSDataCollator())
    assert trainer.args.remove_unused_columns and trainer.train().training_loss > 0


def test_plain_trainer_eval_loss_with_predictions(tmp_path):
    """prediction_loss_only=False (the default) must not trip over the draft's non-logit outputs."""
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=1)
    trainer = Trainer(model=draft, args=_args(tmp_path, prediction_loss_only=False),
                      eval_dataset=_stored_sequences(target, 6), data_collator=PosSDataCollator())
    output = trainer.predict(_stored_sequences(target, 6))
    assert output.metrics["test_loss"] > 0


def test_dataset_columns_passed_to_forward_are_refused():
    target = tiny_llama()
    draft = tiny_draft(target)
    item = _stored_sequences(target, 1)[0]
    with pytest.raises(ValueError, match="PosSDataCollator"):
        draft(input_ids=item["input_ids"][None], target_hidden_states=item["hidden_states"][None],
              assistant_mask=item["assistant_mask"][None])


def test_peft_wrapped_draft_as_assistant_model():
    peft = pytest.importorskip("peft")
    import transformers_poss  # noqa: F401  (tree-aware generate)

    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2)
    lora = peft.get_peft_model(draft, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, assistant_model=lora, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance is not None and len(out.acceptance.accepted_lengths) > 0
    # the adapters are active while drafting: the drafted tree differs from the base draft's
    features = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        adapted = lora.get_base_model()(ids[:, 1:], features).last_hidden_state
        with lora.disable_adapter():
            base = lora.get_base_model()(ids[:, 1:], features).last_hidden_state
    assert not torch.allclose(adapted, base)
