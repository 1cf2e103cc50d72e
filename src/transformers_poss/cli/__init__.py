"""The `poss` command: a thin dispatcher over subcommands (shared loaders: `loaders`).

Each subcommand lives in its own module, imported only when that subcommand runs. A module provides
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status), or ``main(argv) -> int`` when it parses its
own arguments; adding a subcommand is one entry in `COMMANDS` and one in `EXAMPLES`. The conventions every
command follows live in `errors.ShortErrorParser`: kebab-case or snake_case flags, files written where ``--output``
says, a ``--help`` that ends with one example (`epilog`). Subcommands print their results on stdout; the library's
log messages go to stderr as ``[poss COMMAND] message`` (`errors.log_to_stderr`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

WAIT_POLICY_FLAG = "--omp-wait-policy"
WAIT_POLICIES = ("active", "passive")


# name -> (module implementing it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("transformers_poss.cli.demo", "stream answers with the shipped draft; plain vs speculative speed"),
    "generate": ("transformers_poss.cli.generate", "generate text with a target, optionally with a PosS draft"),
    "bench": ("transformers_poss.cli.bench", "measure acceptance and speed-up of decoding methods side by side"),
    "convert": ("transformers_poss.cli.convert", "convert an official PosS / EAGLE / HASS / EAGLE-3 checkpoint"),
    "tune": ("transformers_poss.cli.tune", "choose the tree shape for this machine (cost curve + replay)"),
    "vocab": ("transformers_poss.cli.vocab", "give a draft a reduced drafting vocabulary (no retraining)"),
    "train": ("transformers_poss.training.cli", "train a PosS / EAGLE-2 / HASS draft for a target"),
    "export": ("transformers_poss.cli.export", "a draft as an EAGLE checkpoint (vLLM / SGLang) or a custom_generate folder"),
}

# name -> the one example line that ends the command's --help (README shows the same conventions)
EXAMPLES: dict[str, str] = {
    "demo": "poss demo --max-new-tokens 64 --quantize none",
    "generate": 'poss generate --draft drafts/poss-smollm2-135m-instruct "Name three rivers in Europe."',
    "bench": "poss bench --draft drafts/poss-smollm2-135m-instruct --num-prompts 8 --output bench.json",
    "convert": "poss convert HINT-lab/PosS2-Llama3-8B-Instruct --target meta-llama/Meta-Llama-3-8B-Instruct "
               "--output poss2-llama3",
    "tune": "poss tune --draft drafts/poss-smollm2-135m-instruct --output tune.json",
    "vocab": "poss vocab drafts/poss-smollm2-135m-instruct --target smollm2-135m-instruct --corpus data.jsonl "
             "--size 8192 --output poss-8k",
    "train": "poss train --config recipe.yaml --max-steps 200 --output runs/poss2",
    "export": "poss export drafts/eagle2-smollm2-135m-instruct --format eagle --engine vllm --output out/eagle2-vllm",
}


def epilog(command: str) -> str:
    """The last lines of a command's ``--help``: the flag conventions, then one example."""
    return ("flags: kebab-case or snake_case (--max-new-tokens = --max_new_tokens); files are written where --output "
            f"says\nexample: {EXAMPLES[command]}")


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (first argument that is not an option)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def take_wait_policy(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--omp-wait-policy VALUE`` (or ``--omp_wait_policy=VALUE``, accepted anywhere) and the value.

    OpenMP reads ``OMP_WAIT_POLICY`` once, when torch loads it, so the command sets the variable and starts itself
    again; nothing is changed when the flag is absent (the user's environment decides)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        name, _, inline = arg.partition("=")
        if name.replace("_", "-") == WAIT_POLICY_FLAG:
            if not inline:
                if i + 1 >= len(argv):
                    raise SystemExit(f"poss: error: {WAIT_POLICY_FLAG} needs a value: one of {', '.join(WAIT_POLICIES)}")
                inline, i = argv[i + 1], i + 1
            value = inline.strip().lower()
            if value not in WAIT_POLICIES:
                raise SystemExit(f"poss: error: {WAIT_POLICY_FLAG} {inline!r}: choose one of {', '.join(WAIT_POLICIES)}")
        else:
            rest.append(arg)
        i += 1
    return rest, value


def _restart_with_wait_policy(argv: list[str], policy: str) -> None:
    """Run ``poss argv`` again in a fresh interpreter with ``OMP_WAIT_POLICY=policy`` (a no-op when already set)."""
    if os.environ.get("OMP_WAIT_POLICY", "").lower() == policy:
        return
    os.environ["OMP_WAIT_POLICY"] = policy.upper()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "transformers_poss", *argv])


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Top-level parser; only the chosen subcommand's module is imported to fill in its options."""
    from .errors import ShortErrorParser

    parser = ShortErrorParser(prog="poss", description="PosS tree speculative decoding for transformers")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error (or POSS_DEBUG=1)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (or POSS_NO_PROGRESS=1; also off when stderr is not a terminal)")
    parser.add_argument(WAIT_POLICY_FLAG, choices=WAIT_POLICIES, default=None,
                        help="run with OMP_WAIT_POLICY set to this (default: the environment's; `passive` is faster on "
                             "a busy or shared CPU, `active` on a quiet one: docs/budget.md)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen(argv)
    for name, (module, summary) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=summary, description=summary, epilog=epilog(name))
        if name == chosen:
            importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point: ``poss COMMAND [options]``."""
    from .errors import disable_progress_bars, take_debug_flag, take_no_progress_flag

    argv = list(sys.argv[1:] if argv is None else argv)
    argv, policy = take_wait_policy(argv)
    if policy is not None:
        _restart_with_wait_policy(argv, policy)
    argv, debug = take_debug_flag(argv)
    argv, no_progress = take_no_progress_flag(argv)
    restore = disable_progress_bars() if no_progress else None
    try:
        return _run(argv, debug)
    finally:
        if restore is not None:
            restore()


def _run(argv: list[str], debug: bool) -> int:
    from .errors import log_to_stderr, run_reporting_errors, short_warnings

    short_warnings(debug)
    chosen = _chosen(argv)
    if chosen in COMMANDS:
        log_to_stderr(chosen)  # the library's log messages, from info up (TRANSFORMERS_VERBOSITY sets the level)
    if chosen in COMMANDS and argv and argv[0] == chosen:
        module = importlib.import_module(COMMANDS[chosen][0])
        if hasattr(module, "main"):  # a subcommand with a parser of its own (`poss train`: HfArgumentParser)
            return run_reporting_errors(chosen, module.main, argv[1:], debug=debug)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.version:
        from importlib.metadata import version

        print(f"transformers-poss {version('transformers-poss')}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return run_reporting_errors(args.command, module.run, args, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
