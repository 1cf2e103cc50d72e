"""The command line: a user error is one or two lines on stderr and a non-zero exit, never a traceback, and every
check that can be made before loading a model is made before."""

import io
import json
import subprocess
import sys

import pytest

from helpers import tiny_draft, tiny_llama
from transformers_poss import cli
from transformers_poss.targets import embedded
from transformers_poss.cli import bench as bench_cli
from transformers_poss.cli import loaders


def _patch_load_target(monkeypatch, replacement):
    """Replace load_target where the commands look it up (the target module, the CLI loaders, `poss bench`)."""
    for module in (embedded, loaders, bench_cli):
        monkeypatch.setattr(module, "load_target", replacement)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if any command loads a target."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    _patch_load_target(monkeypatch, refuse)
    monkeypatch.delenv("POSS_DEBUG", raising=False)


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["What is 2 + 2?"]}\n')
    return path


def _short_error(capsys, argv, fragment):
    """Run ``poss argv``: exit status 2, at most two lines on stderr naming the problem, no traceback."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) <= 2 and "Traceback" not in err, err
    assert lines[0].startswith(f"poss {argv[0]}: error: ") and fragment in lines[0], err
    return lines[0]


@pytest.mark.parametrize("option, value, message", [
    ("--num-prompts", "-1", "expected an integer >= 1, got -1"),
    ("--num-prompts", "0", "expected an integer >= 1, got 0"),
    ("--temperature", "-1", "expected a temperature >= 0"),
    ("--tree-depth", "0", "expected an integer >= 1, got 0"),
    ("--tree-depth", "2.7", "expected an integer >= 1, got '2.7'"),
    ("--tree-total-tokens", "1", "number of tree nodes >= 2"),
    ("--max-new-tokens", "0", "expected an integer >= 1"),
    ("--top-p", "1.5", "expected a number in (0, 1]"),
    ("--threads", "0", "expected an integer >= 1"),
    ("--batch-size", "0", "expected an integer >= 1"),
    ("--sweep-depths", "3,0", "integers >= 1"),
])
def test_bench_numbers_are_refused_while_parsing(capsys, no_model_loads, questions, option, value, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--questions", str(questions), option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2 and "usage:" not in err  # no 20-line usage dump


def test_tree_total_tokens_auto_any_case(questions):
    parser = cli.build_parser(["bench"])
    for spelling in ("auto", "Auto", " AUTO "):
        args = parser.parse_args(["bench", "--questions", str(questions), "--tree-total-tokens", spelling])
        assert args.tree_total_tokens == "auto"


@pytest.mark.parametrize("content, fragment", [
    ('{"turns": ["a"]}\n{oops\n', "q.jsonl:2: not valid JSON"),
    ('{"question_id": 1}\n', "q.jsonl:1: a question needs a non-empty 'turns' list"),
])
def test_bench_bad_question_file_before_the_model_loads(capsys, no_model_loads, tmp_path, content, fragment):
    path = tmp_path / "q.jsonl"
    path.write_text(content)
    _short_error(capsys, ["bench", "--questions", str(path)], fragment)


def test_bench_missing_question_file(capsys, no_model_loads, tmp_path):
    _short_error(capsys, ["bench", "--questions", str(tmp_path / "nope.jsonl")], "does not exist")


def test_bench_target_folder_as_draft_is_refused_before_loading(capsys, no_model_loads, tmp_path, questions):
    tiny_llama().save_pretrained(tmp_path / "llama")
    capsys.readouterr()  # the save's progress bar
    line = _short_error(capsys, ["bench", "--questions", str(questions), "--draft", str(tmp_path / "llama")],
                        "is not a PosS draft")
    assert "pass it as the target" in line


def test_bench_missing_draft_and_unwritable_output(capsys, no_model_loads, tmp_path, questions):
    _short_error(capsys, ["bench", "--questions", str(questions), "--draft", str(tmp_path / "nope")],
                 "no such draft folder")
    (tmp_path / "file").write_text("")
    _short_error(capsys, ["bench", "--questions", str(questions), "--output", str(tmp_path / "file" / "r.json")],
                 "is a file, not a folder")


def test_generate_empty_prompt_on_stdin(capsys, no_model_loads, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    _short_error(capsys, ["generate"], "the prompt on stdin is empty")


def test_generate_bad_numbers(capsys, no_model_loads):
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--temperature", "-1"])
    assert "expected a temperature >= 0" in capsys.readouterr().err


def test_generate_missing_target_folder(capsys, no_model_loads):
    _short_error(capsys, ["generate", "hi", "--target", "./no/such/target"], "no such target folder")


def test_vocab_bad_corpus_line_before_loading(capsys, no_model_loads, tmp_path):
    tiny_draft(tiny_llama()).save_pretrained(tmp_path / "draft")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "ok"}\n{"text": \n')
    capsys.readouterr()  # the save's progress bar
    _short_error(capsys, ["vocab", str(tmp_path / "draft"), "--target", "x", "--corpus", str(corpus),
                          "--output", str(tmp_path / "out")], "c.jsonl:2: not valid JSON")


def test_vocab_size_zero(capsys, no_model_loads, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["vocab", "d", "--target", "x", "--corpus", "c", "--output", "o", "--size", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_convert_missing_source(capsys, no_model_loads, tmp_path):
    _short_error(capsys, ["convert", str(tmp_path / "nope"), "--output", str(tmp_path / "out")],
                 "no such checkpoint folder")


def test_tune_bad_questions_before_loading(capsys, no_model_loads, tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("{bad\n")
    _short_error(capsys, ["tune", "--draft", "d", "--questions", str(path)], "q.jsonl:1: not valid JSON")


def _train_config(tmp_path, **draft):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                                 "content": "a"}]}) + "\n")
    config = {"target": "x", "output_dir": str(tmp_path / "out"), "data": {"train": [str(data)]},
              "draft": {"num_specialists": 2, "positions_per_specialist": 1, **draft}, "training": {"use_cpu": True}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(config))
    return path


def test_train_bad_draft_shape_before_loading(capsys, no_model_loads, tmp_path):
    _short_error(capsys, ["train", "--config", str(_train_config(tmp_path, num_specialists=0))],
                 "`--num_specialists` must be an integer >= 1, got 0")


def test_train_missing_data_file_before_loading(capsys, no_model_loads, tmp_path):
    _short_error(capsys, ["train", "--config", str(_train_config(tmp_path)), "--train", str(tmp_path / "no.jsonl")],
                 "no.jsonl does not exist")


def test_train_draft_that_cannot_fit_fails_before_data_and_features(capsys, monkeypatch, tmp_path):
    from transformers_poss.training import cli as train_cli

    _patch_load_target(monkeypatch, lambda *a, **k: (tiny_llama(), None))

    def no_data(*args, **kwargs):
        raise AssertionError("the data stage ran before the draft shape was checked")

    monkeypatch.setattr(train_cli, "build_datasets", no_data)
    _short_error(capsys, ["train", "--config", str(_train_config(tmp_path, draft_vocab_size=4096))],
                 "the draft does not fit the target x")


def test_train_debug_flag(monkeypatch, no_model_loads, tmp_path):
    with pytest.raises(ValueError, match="must be an integer >= 1, got 0"):
        cli.main(["train", "--debug", "--config", str(_train_config(tmp_path, num_specialists=0))])


def test_debug_flag_and_environment_show_the_traceback(monkeypatch, no_model_loads):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(ValueError, match="prompt on stdin is empty"):
        cli.main(["--debug", "generate"])
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(ValueError, match="prompt on stdin is empty"):
        cli.main(["generate", "--debug"])
    monkeypatch.setenv("POSS_DEBUG", "1")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(ValueError, match="prompt on stdin is empty"):
        cli.main(["generate"])


def test_installed_command_prints_two_lines_and_exits_non_zero(tmp_path):
    result = subprocess.run([sys.executable, "-m", "transformers_poss", "bench", "--questions",
                             str(tmp_path / "missing.jsonl")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in result.stderr
    assert "missing.jsonl does not exist" in lines[0] and "POSS_DEBUG=1" in lines[1]


def test_vocab_corpus_without_text_before_loading(capsys, no_model_loads, tmp_path):
    tiny_draft(tiny_llama()).save_pretrained(tmp_path / "draft")
    corpus = tmp_path / "q.jsonl"
    corpus.write_text('{"turns": ["a question, not a conversation"]}\n')
    with pytest.raises(SystemExit, match="the corpus holds no text"):
        cli.main(["vocab", str(tmp_path / "draft"), "--target", "x", "--corpus", str(corpus), "--output", "o"])


def test_warnings_are_one_line(capsys, monkeypatch):
    import warnings

    from transformers_poss.cli.errors import short_warnings

    monkeypatch.delenv("POSS_DEBUG", raising=False)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    short_warnings()
    warnings.warn("near-ties ahead", UserWarning)
    assert capsys.readouterr().err == "poss: warning: near-ties ahead\n"


def test_tune_save_needs_a_local_draft_folder(capsys, no_model_loads, monkeypatch):
    from transformers_poss.checkpoints import loading as loading_checks

    monkeypatch.setattr(loading_checks, "check_draft_source", lambda source: None)  # pretend the Hub id exists
    _short_error(capsys, ["tune", "--draft", "someone/some-draft", "--save"], "--save writes the chosen shape")


def test_generate_missing_draft_before_loading(capsys, no_model_loads):
    _short_error(capsys, ["generate", "hi", "--draft", "./no/draft"], "no such draft folder")


def test_bench_official_draft_error_comes_from_its_loader(tmp_path):
    from test_official import _official_state, _write

    from transformers_poss.cli.loaders import load_draft

    target = tiny_llama()
    folder = _write(tmp_path / "tiny-eagle", _official_state(target, layers=3))  # 3 layers, no PosS<N> in the name
    with pytest.raises(ValueError, match="pass positions_per_specialist=N"):
        load_draft(str(folder), target)
    assert load_draft(str(_write(tmp_path / "PosS2-tiny", _official_state(target, layers=3))), target).is_attached


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})



def test_vocab_corpus_bad_json_line_is_an_error_not_text(tmp_path):
    from transformers_poss.cli.vocab import corpus_texts

    path = tmp_path / "corpus.jsonl"
    path.write_text(GOOD + '\n{"messages": [\n')
    with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
        list(corpus_texts([path]))
    text = tmp_path / "corpus.txt"
    text.write_text("plain words\n" + GOOD + "\n")
    assert list(corpus_texts([text])) == ["plain words", "yo"]
    null = tmp_path / "null.jsonl"
    null.write_text(json.dumps({"messages": [{"role": "assistant", "content": None}]}) + "\n")
    with pytest.raises(ValueError, match=f"{null}:1: an assistant message has no text"):
        list(corpus_texts([null]))




def test_commands_show_the_library_log_on_stderr(capsys, monkeypatch):
    """The library logs (no print); a command shows its messages from info up as `[poss COMMAND] message`, at the
    level TRANSFORMERS_VERBOSITY names, and replaces its handler when another command runs in the same process."""
    import logging

    from transformers.utils import logging as hf_logging

    from transformers_poss.cli.errors import log_to_stderr

    package = logging.getLogger("transformers_poss")
    monkeypatch.setattr(package, "handlers", list(package.handlers))
    monkeypatch.setattr(package, "level", package.level)
    logger = hf_logging.get_logger("transformers_poss.bench.run")
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    log_to_stderr("bench")
    logger.info("plot: x.png")
    log_to_stderr("tune")
    logger.info("again")
    assert capsys.readouterr().err == "[poss bench] plot: x.png\n[poss tune] again\n"  # one handler at a time
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "warning")
    log_to_stderr("bench")
    logger.info("hidden")
    logger.warning("shown")
    assert capsys.readouterr().err == "[poss bench] shown\n"


def test_tune_explains_a_prediction_that_misses_by_more_than_ten_percent():
    from transformers_poss.cli.tune import prediction_gap

    assert prediction_gap(1.20, 1.25, 2.0, 2.1) is None  # within 10%
    acceptance = prediction_gap(1.20, 0.90, 2.0, 1.5)  # tau 0.75x, cost as predicted
    assert "acceptance length was 0.75x" in acceptance and "round cost" not in acceptance
    cost = prediction_gap(1.20, 0.80, 2.0, 2.0)  # same tau, rounds 1.5x dearer
    assert "round cost 1.50x" in cost and "acceptance" not in cost
    both = prediction_gap(1.0, 0.5, 2.0, 1.6)
    assert "acceptance length was 0.80x" in both and "round cost 1.60x" in both and "50%" in both
