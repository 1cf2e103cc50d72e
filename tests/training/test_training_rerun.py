"""`poss train` again into an output_dir whose checkpoints hold another draft: refused before any model loads, with
what changed and what to do (it used to keep the old weights under the new recipe, or fail in the optimizer)."""

import json

import pytest

from helpers import tiny_draft, tiny_llama
from transformers_poss.training.config import parse_train_args
from transformers_poss.training.recipe_checks import check_recipe

GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


def _config(tmp_path, *flags):
    data = tmp_path / "train.jsonl"
    data.write_text(GOOD + "\n")
    return parse_train_args(["--target", "x", "--train", str(data), "--output_dir", str(tmp_path / "out"),
                             "--use_cpu", "true", *flags])


def _checkpoint(tmp_path, step=4, **kwargs):
    draft = tiny_draft(tiny_llama(), **kwargs)
    folder = tmp_path / "out" / f"checkpoint-{step}"
    draft.save_pretrained(folder)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_same_recipe_resumes(tmp_path):
    _checkpoint(tmp_path, num_specialists=2, positions_per_specialist=2)
    check_recipe(_config(tmp_path, "--num_specialists", "2", "--positions_per_specialist", "2"))


@pytest.mark.parametrize("flags, problem", [
    (["--num_specialists", "3", "--positions_per_specialist", "2"], "num_specialists 2 there, 3 now"),
    (["--num_specialists", "2", "--positions_per_specialist", "4"], "positions_per_specialist 2 there, 4 now"),
    (["--num_specialists", "2", "--positions_per_specialist", "2", "--layer_style", "eagle3", "--feature_layers",
      "1", "2"], "feature_layers None there, [1, 2] now"),
])
def test_changed_recipe_is_refused(tmp_path, flags, problem):
    _checkpoint(tmp_path, num_specialists=2, positions_per_specialist=2)
    with pytest.raises(ValueError, match=r"out holds checkpoint-4 of another draft \(.*" + problem.replace("[", r"\[")
                       .replace("]", r"\]")):
        check_recipe(_config(tmp_path, *flags))


def test_an_incomplete_newer_checkpoint_is_not_compared(tmp_path):
    _checkpoint(tmp_path, step=2, num_specialists=2, positions_per_specialist=1)
    (tmp_path / "out" / "checkpoint-6").mkdir()  # interrupted save: no trainer_state.json
    with pytest.raises(ValueError, match="checkpoint-2 of another draft"):
        check_recipe(_config(tmp_path, "--num_specialists", "1"))


def test_rerun_on_the_command_line_is_a_short_error(tmp_path, capsys):
    from transformers_poss.cli import main

    _checkpoint(tmp_path, num_specialists=2, positions_per_specialist=2)
    data = tmp_path / "train.jsonl"
    data.write_text(GOOD + "\n")
    code = main(["train", "--target", "x", "--train", str(data), "--output_dir", str(tmp_path / "out"),
                 "--num_specialists", "2", "--positions_per_specialist", "4", "--use_cpu", "true"])
    err = capsys.readouterr().err
    assert code == 2 and "of another draft" in err and "Traceback" not in err


def test_an_interrupted_run_says_what_it_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C during `poss train`: the data, features and newest complete checkpoint it leaves are named."""
    import transformers_poss.cli as cli
    from transformers_poss.training import cli as train_cli

    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    (out / "data" / "conversations.jsonl").write_text('{"id": 0, "messages": []}\n{"id": 1, "messages": []}\n')
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')

    def stopped(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "run", stopped)
    status = cli.main(["train", "--target", "smollm2-135m-instruct", "--train", str(data), "--output_dir", str(out)])
    assert status == 130
    err = capsys.readouterr().err
    assert "2 line(s) in" in err and "conversations.jsonl" in err and "no complete checkpoint yet" in err
    assert "Run the same command again to resume" in err
