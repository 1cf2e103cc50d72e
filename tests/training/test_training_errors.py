"""Training inputs: checkpoints, data files, feature shards and the recipe are checked before (or while) running."""

import gzip
import json

import pytest
import torch
from safetensors.torch import save_file

from helpers import tiny_draft, tiny_llama

@pytest.fixture(scope="module")
def target():
    return tiny_llama()


# ---------------------------------------------------------------------------------------------------- checkpoints
def _checkpoint(folder, step, state=True, weights=True):
    folder.mkdir(parents=True)
    if weights:
        save_file({"w": torch.zeros(4)}, folder / "model.safetensors")
    if state:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_resume_skips_half_written_checkpoints(tmp_path):
    from transformers_poss.training.checkpoints import last_complete_checkpoint

    good = _checkpoint(tmp_path / "checkpoint-10", 10)
    _checkpoint(tmp_path / "checkpoint-20", 20, state=False)  # killed before the trainer state
    cut = _checkpoint(tmp_path / "checkpoint-30", 30)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 8])
    _checkpoint(tmp_path / "checkpoint-40", 40)
    (tmp_path / "checkpoint-40" / "trainer_state.json").write_text('{"global_st')  # cut-off state
    with pytest.warns(UserWarning, match="incomplete"):
        assert last_complete_checkpoint(tmp_path) == str(good)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-10", "incomplete-checkpoint-20", "incomplete-checkpoint-30", "incomplete-checkpoint-40"]
    assert last_complete_checkpoint(tmp_path / "missing") is None


def test_train_cli_resumes_from_the_last_complete_checkpoint(tmp_path):
    from transformers_poss.training.cli import _last_checkpoint

    _checkpoint(tmp_path / "checkpoint-5", 5)
    _checkpoint(tmp_path / "checkpoint-9", 9, weights=False)
    with pytest.warns(UserWarning, match="checkpoint-9 is incomplete"):
        assert _last_checkpoint(str(tmp_path)).endswith("checkpoint-5")


# ---------------------------------------------------------------------------------------------------- data files
GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


def test_bad_json_line_names_file_and_line(tmp_path):
    from transformers_poss.training.data import load_conversations

    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "\n" + GOOD + "\n{oops\n")
    with pytest.raises(ValueError, match=f"{path}:3: not valid JSON"):
        load_conversations(str(path))


def test_truncated_gzip_names_the_file(tmp_path):
    from transformers_poss.training.data import load_conversations

    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write((GOOD + "\n") * 300)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match=f"{path}: cannot be read .*truncated"):
        load_conversations(str(path))


@pytest.mark.parametrize("messages, problem", [
    ("hello", "must be a list of messages, got a str"),
    (["hello"], "Message 1 must be an object"),
    ([{"role": "user", "content": None}, {"role": "assistant", "content": "x"}], "Message 1 has no content"),
    ([{"role": "user"}, {"role": "assistant", "content": "x"}], "Message 1 has no content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}], "Message 2 has content of type int"),
])
def test_malformed_messages_name_file_and_example(tmp_path, messages, problem):
    from transformers_poss.training.data import load_conversations

    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=f"{path}: example 2: .*{problem}"):
        load_conversations(str(path))


def test_missing_data_file_is_not_a_dataset_name(tmp_path):
    from transformers_poss.training.data import load_conversations

    with pytest.raises(FileNotFoundError, match="no such data file"):
        load_conversations(str(tmp_path / "nope.jsonl"))


def test_distilled_file_with_a_cut_off_last_line_resumes(tmp_path):
    from transformers_poss.training.distill import read_jsonl

    path = tmp_path / "conversations.jsonl"
    path.write_text('{"id": 0}\n{"id": 1}\n{"id": 2, "mess')
    with pytest.warns(UserWarning, match="cut off"):
        assert read_jsonl(path) == [{"id": 0}, {"id": 1}]
    assert path.read_text() == '{"id": 0}\n{"id": 1}\n'  # appending continues cleanly
    path.write_text('{"id": 0}\n{bad\n{"id": 2}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
        read_jsonl(path)


# ---------------------------------------------------------------------------------------------------- feature shards
def test_feature_shards_are_recomputed_for_another_target(tmp_path):
    from transformers_poss.training.features import FeatureShardDataset, TargetFeatures, write_feature_shards

    item = {"input_ids": torch.arange(12), "assistant_mask": torch.ones(12, dtype=torch.long)}
    first, second = tiny_llama(seed=0), tiny_llama(seed=7)
    write_feature_shards(first, [item], tmp_path, dtype=torch.float32, progress=False)
    write_feature_shards(second, [item], tmp_path, dtype=torch.float32, progress=False)
    stored = FeatureShardDataset(tmp_path)[0]["hidden_states"]
    expected = TargetFeatures(second)(item["input_ids"][None])[0]
    torch.testing.assert_close(stored, expected)
    index = json.loads((tmp_path / "features.json").read_text())
    assert index["target_fingerprint"]


def test_fingerprint_tracks_weights_not_only_the_name():
    from transformers_poss.training.features import target_fingerprint

    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    assert target_fingerprint(a) == target_fingerprint(b)
    with torch.no_grad():
        b.lm_head.weight.mul_(1.01)
    assert target_fingerprint(a) != target_fingerprint(b)


def _run_config(tmp_path, *flags):
    from transformers_poss.training.config import parse_train_args

    data = tmp_path / "train.jsonl"
    data.write_text(GOOD + "\n")
    return parse_train_args(["--target", "x", "--train", str(data), "--output_dir", str(tmp_path / "out"),
                             "--use_cpu", "true", *flags])


@pytest.mark.parametrize("flags, problem", [
    (["--num_specialists", "0"], "`--num_specialists` must be an integer >= 1, got 0"),
    (["--positions_per_specialist", "-2"], "`--positions_per_specialist` must be an integer >= 1, got -2"),
    (["--train", "missing.jsonl"], "--train file missing.jsonl does not exist"),
    (["--train", "./data/missing"], "no such --train file"),
    (["--eval_fraction", "1.0"], "must be below 1"),
    (["--init_from", "./no/such/draft"], "no such --init_from draft folder"),
    (["--generation_max_new_tokens", "0"], "`--generation_max_new_tokens` must be an integer >= 1"),
])
def test_recipe_checks(tmp_path, flags, problem):
    from transformers_poss.training.recipe_checks import check_recipe

    check_recipe(_run_config(tmp_path))  # the unchanged run passes
    with pytest.raises((ValueError, FileNotFoundError), match=problem):
        check_recipe(_run_config(tmp_path, *flags))


def test_prompts_file_needs_prompt_strings(tmp_path):
    from transformers_poss.training.recipe_checks import check_recipe

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=f'{prompts}: record 2 needs a non-empty "prompt" string'):
        check_recipe(_run_config(tmp_path, "--prompts", str(prompts)))


def test_init_from_vocabulary_conflict_is_found_before_the_data_stage(tmp_path, target):
    from transformers_poss.training.recipe_checks import check_recipe
    from transformers_poss.vocab import set_token_map

    source = tiny_draft(target, num_specialists=1)
    set_token_map(source, torch.arange(32))
    source.save_pretrained(tmp_path / "eagle")
    check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "eagle"), "--draft_vocab_size", "32"))
    with pytest.raises(ValueError, match="--draft_vocab_size 16 differs from the vocabulary of --init_from"):
        check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "eagle"), "--draft_vocab_size", "16"))
    target.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="is not a PosS draft"):
        check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "llama")))


def test_draft_shape_is_checked_against_the_target(tmp_path, target):
    from transformers_poss.training.recipe_checks import check_draft_fits

    check_draft_fits(_run_config(tmp_path), target)
    with pytest.raises(ValueError, match="the draft does not fit the target x: `draft_vocab_size` \\(500\\) exceeds"):
        check_draft_fits(_run_config(tmp_path, "--draft_vocab_size", "500"), target)


def test_feature_layers_and_init_from_layouts_are_checked_before_the_data_stage(tmp_path):
    from transformers_poss.training.recipe_checks import check_draft_fits, check_recipe

    target = tiny_llama(layers=4)
    e3 = tiny_draft(target, num_specialists=1, feature_layers=[1, 2, 4])
    e3.save_pretrained(tmp_path / "e3")
    tiny_draft(target, num_specialists=1, layer_style="eagle3").save_pretrained(tmp_path / "midlayer")
    check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "e3"), "--feature_layers", "1", "2", "4"))
    with pytest.raises(ValueError, match=r"reads feature_layers=\[1, 2, 4\]; this draft reads the post-norm feature"):
        check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "e3")))
    with pytest.raises(ValueError, match="set --feature_layers 1 2 4"):
        check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "e3"), "--feature_layers", "0", "3"))
    with pytest.raises(ValueError, match="'eagle3' layers; this draft has 'eagle2' layers"):
        check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "midlayer")))
    with pytest.raises(ValueError, match="repeated layer"):
        check_recipe(_run_config(tmp_path, "--feature_layers", "2", "2"))
    check_draft_fits(_run_config(tmp_path, "--feature_layers", "0", "4"), target)
    with pytest.raises(ValueError, match=r"does not fit the target x: `feature_layers` \[2, 5\] must lie in \[0, 4\]"):
        check_draft_fits(_run_config(tmp_path, "--feature_layers", "2", "5"), target)


# ---------------------------------------------------------------------------------------------------- found later


def test_checkpoints_appear_only_once_complete(tmp_path, monkeypatch):
    from transformers import Trainer

    from test_training_trainer import _args, _sequences
    from transformers_poss.training.checkpoints import last_complete_checkpoint
    from transformers_poss.training.trainer import PosSTrainer

    target = tiny_llama()
    out = tmp_path / "out"

    def trainer():
        args = _args(tmp_path, output_dir=str(out), max_steps=6, save_strategy="steps", save_steps=3)
        return PosSTrainer(model=tiny_draft(target).train(), args=args, target=target, train_dataset=_sequences(24))

    saves = []
    original = Trainer._save_rng_state

    def killed_on_second_save(self, output_dir):
        saves.append(output_dir)
        if len(saves) == 2:
            raise KeyboardInterrupt  # the process dies while checkpoint-6 is being written
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", killed_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        trainer().train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]
    assert (out / ".staging" / "checkpoint-6").is_dir()  # the half-written one never got its final name
    assert last_complete_checkpoint(out) == str(out / "checkpoint-3")
    monkeypatch.setattr(Trainer, "_save_rng_state", original)
    trainer().train(resume_from_checkpoint=last_complete_checkpoint(out))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-6"]
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6


def test_atomic_checkpoints_keep_the_save_total_limit(tmp_path):
    from test_training_trainer import _args, _sequences
    from transformers_poss.training.trainer import PosSTrainer

    target = tiny_llama()
    args = _args(tmp_path, output_dir=str(tmp_path / "out"), max_steps=6, save_strategy="steps", save_steps=2,
                 save_total_limit=2)
    PosSTrainer(model=tiny_draft(target).train(), args=args, target=target, train_dataset=_sequences(24)).train()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-4", "checkpoint-6"]


