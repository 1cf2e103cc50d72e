"""The conventions every `poss` command follows: flags in kebab-case or snake_case, files written where `--output`
says (`--output_dir` in `poss train`, positional outputs of `convert` / `export` as a deprecated alias), and a
`--help` that ends with one example line."""

import pytest

from transformers_poss import cli
from transformers_poss.cli.errors import output_argument

# one multi-word flag per command, with a value, and the arguments the command needs besides it
FLAGS = {
    "demo": ([], "--max-new-tokens", "7", "max_new_tokens", 7),
    "generate": (["hi"], "--tree-top-k", "3", "tree_top_k", 3),
    "bench": ([], "--num-prompts", "2", "num_prompts", 2),
    "convert": (["src", "--output", "out"], "--positions-per-specialist", "2", "positions_per_specialist", 2),
    "tune": (["--draft", "d"], "--max-new-tokens", "9", "max_new_tokens", 9),
    "vocab": (["d", "--target", "t", "--corpus", "c", "--output", "o"], "--size", "64", "size", 64),
    "export": (["d", "--output", "o"], "--reduced-vocab", "full", "reduced_vocab", "full"),
}
WRITERS = {"bench": [], "convert": ["src"], "tune": ["--draft", "d"], "export": ["d"],
           "vocab": ["d", "--target", "t", "--corpus", "c"]}


def _parse(argv):
    return cli.build_parser(argv).parse_args(argv)


def test_every_command_is_covered():
    assert set(FLAGS) | {"train"} == set(cli.COMMANDS) == set(cli.EXAMPLES)


@pytest.mark.parametrize("command", sorted(FLAGS))
def test_kebab_and_snake_case_spellings(command):
    rest, flag, value, dest, expected = FLAGS[command]
    snake = "--" + flag[2:].replace("-", "_")
    parsed = [_parse([command, *rest, spelling, value]) for spelling in (flag, snake)]
    parsed.append(_parse([command, *rest, f"{snake}={value}"]))
    assert [getattr(args, dest) for args in parsed] == [expected] * 3
    assert vars(parsed[0]) == vars(parsed[1]) == vars(parsed[2])


def test_snake_case_spelling_of_an_unknown_flag_is_still_an_error(capsys):
    with pytest.raises(SystemExit) as info:
        _parse(["demo", "--max_new_tokenz", "3"])
    assert info.value.code == 2 and "--max_new_tokenz" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_output_flag(command):
    args = _parse([command, *WRITERS[command], "--output", "somewhere"])
    assert args.output == "somewhere"


@pytest.mark.parametrize("command", ["convert", "export"])
def test_positional_output_is_a_deprecated_alias(command):
    args = _parse([command, *WRITERS[command], "old-place"])
    with pytest.warns(FutureWarning, match="--output old-place"):
        assert output_argument(args, command) == "old-place"
    args = _parse([command, *WRITERS[command], "a", "--output", "b"])
    with pytest.raises(ValueError, match="two outputs"):
        output_argument(args, command)
    with pytest.raises(ValueError, match="--output"):
        output_argument(_parse([command, *WRITERS[command]]), command)


def test_train_flags_and_output():
    from transformers_poss.training.config import parse_train_args

    base = ["--target", "some-target"]
    kebab = parse_train_args([*base, "--max-steps", "5", "--output", "runs/a"])
    snake = parse_train_args([*base, "--max_steps", "5", "--output_dir", "runs/a"])
    mixed = parse_train_args([*base, "--max_steps=5", "--output-dir=runs/a"])
    for config in (kebab, snake, mixed):
        assert config.training.max_steps == 5 and config.training.output_dir == "runs/a"


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_ends_with_one_example(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-1] == f"example: {cli.EXAMPLES[command]}"
    assert lines[-1].startswith(f"example: poss {command} ")
    assert sum(line.startswith("example:") for line in lines) == 1
