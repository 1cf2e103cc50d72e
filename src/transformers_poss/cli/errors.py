"""User errors on the command line: one or two lines on stderr and a non-zero exit, never a traceback.

``poss --debug COMMAND ...`` (or ``POSS_DEBUG=1``) shows the full traceback instead. The argparse types below refuse
bad numbers while the command line is parsed, before any model is loaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..checks import is_auto

EXIT_USER_ERROR = 2


class ShortErrorParser(argparse.ArgumentParser):
    """The parser of every `poss` command, with the command-line conventions in one place:

    - usage errors are two lines (the error, then where the help is), not the full usage;
    - every flag is accepted in kebab-case and in snake_case (``--max-new-tokens`` / ``--max_new_tokens``), as
      `poss train` (transformers' `HfArgumentParser`) accepts both: options are defined in kebab-case and a
      snake_case spelling on the command line is read as its kebab-case twin;
    - the help ends with the ``epilog`` (one example line), printed as written.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([self._kebab(arg) for arg in args], namespace)

    def _kebab(self, arg: str) -> str:
        """``--snake_case[=value]`` as ``--snake-case[=value]`` when only the kebab-case option exists here."""
        if not arg.startswith("--") or "_" not in arg.partition("=")[0]:
            return arg
        name, sep, value = arg.partition("=")
        kebab = name.replace("_", "-")
        known = self._option_string_actions
        return f"{kebab}{sep}{value}" if name not in known and kebab in known else arg


def add_output_argument(parser, help: str, required: bool = False) -> None:
    """``--output`` (where the command writes) and, for the commands that took it positionally, the old positional
    spelling, still read (deprecated: `output_argument` warns) and hidden from the help."""
    parser.add_argument("--output", default=None, required=required, help=help)
    if not required:
        parser.add_argument("positional_output", nargs="?", default=None, help=argparse.SUPPRESS)


def output_argument(args, command: str) -> str:
    """The folder or file ``args`` says to write: ``--output``, else the deprecated positional one (with a warning)."""
    positional = getattr(args, "positional_output", None)
    if positional is not None:
        if args.output is not None and args.output != positional:
            raise ValueError(f"two outputs given ({positional} and --output {args.output}); give only --output.")
        import warnings

        warnings.warn(f"`poss {command} ... {positional}` (a positional output) is deprecated and will be removed; "
                      f"write `--output {positional}`.", FutureWarning, stacklevel=2)
        args.output = positional
    if args.output is None:
        raise ValueError(f"no output given: `poss {command}` writes where --output says (--output FOLDER).")
    return args.output


def debug_requested(debug: bool = False) -> bool:
    """``--debug`` was given, or ``POSS_DEBUG`` is set (to anything but 0)."""
    return bool(debug) or os.environ.get("POSS_DEBUG", "").strip() not in ("", "0")


def take_debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (accepted anywhere, also for subcommands with their own parser) and whether it
    was there."""
    return [a for a in argv if a != "--debug"], "--debug" in argv


def take_no_progress_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--no-progress`` (accepted anywhere) and whether progress bars are off: the flag,
    ``POSS_NO_PROGRESS=1``, or a standard error that is not a terminal (no carriage returns in captured logs)."""
    flags = ("--no-progress", "--no_progress")
    off = any(a in flags for a in argv) or os.environ.get("POSS_NO_PROGRESS", "").strip().lower() in ("1", "true", "yes")
    return [a for a in argv if a not in flags], off or not _is_terminal(sys.stderr)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def disable_progress_bars():
    """Every progress bar off for this command: transformers' (the library's bars and "Loading weights"), the Hub's
    downloads, and the Trainer's (`poss train` reads ``POSS_NO_PROGRESS``). Commands call this, never the library.
    Returns a function that puts everything back (for `cli.main` called from Python)."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from huggingface_hub.utils import disable_progress_bars as hub_off
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled(), os.environ.get("POSS_NO_PROGRESS")
    hf_logging.disable_progress_bar()
    hub_off()
    os.environ["POSS_NO_PROGRESS"] = "1"

    def restore() -> None:
        if was[0]:
            hf_logging.enable_progress_bar()
        if not was[1]:
            enable_progress_bars()
        if was[2] is None:
            os.environ.pop("POSS_NO_PROGRESS", None)
        else:
            os.environ["POSS_NO_PROGRESS"] = was[2]

    return restore


def short_message(error: BaseException) -> str:
    """The error's message on one line (an install command on a second line is kept)."""
    text = str(error).strip()
    if isinstance(error, KeyError) and error.args:
        text = f"missing key {error.args[0]!r}"
    if isinstance(error, OSError) and getattr(error, "filename", None) and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if len(lines) > 1 and lines[-1].startswith("pip install"):
        return " ".join(lines[:-1]) + "\n    " + lines[-1]
    return " ".join(lines)


def report(command: str, error: BaseException, stream=None) -> int:
    """Print ``poss COMMAND: error: MESSAGE`` and the debug hint; return the exit status."""
    stream = stream or sys.stderr
    kind = "" if isinstance(error, (ValueError, OSError, KeyError)) else f"{type(error).__name__}: "
    print(f"poss {command}: error: {kind}{short_message(error)}", file=stream)
    print("(run `poss --debug ...` or set POSS_DEBUG=1 for the traceback)", file=stream)
    return EXIT_USER_ERROR


def run_reporting_errors(command: str, run, args, debug: bool = False) -> int:
    """``run(args)``, with exceptions turned into a short report unless debugging was asked for."""
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print(f"poss {command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as error:  # noqa: BLE001 - every error reaches the user as a short message
        if debug_requested(debug):
            raise
        return report(command, error)


def short_warnings(debug: bool = False) -> None:
    """Show warnings as one line, ``poss: warning: MESSAGE`` (no source line), unless debugging."""
    import warnings

    if debug_requested(debug):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"poss: warning: {message}", file=file or sys.stderr)

    warnings.showwarning = show


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever ``sys.stderr`` is when a message is logged (not when it was made)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ / setStream assign it; the current sys.stderr is always used
        pass


def log_to_stderr(command: str) -> None:
    """Show the package's log messages on stderr as ``[poss COMMAND] message``.

    The library logs through `logging` (``transformers.utils.logging.get_logger``) and prints nothing itself; the
    command shows its messages from level info up, or from the level ``TRANSFORMERS_VERBOSITY`` names (``debug``,
    ``info``, ``warning``, ``error``, ``critical``), as transformers does for its own. Calling it again (another
    command in the same process) replaces the handler it installed.
    """
    package = logging.getLogger("transformers_poss")
    for handler in [h for h in package.handlers if isinstance(h, _StderrHandler)]:
        package.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(f"[poss {command}] %(message)s"))
    package.addHandler(handler)
    level = os.environ.get("TRANSFORMERS_VERBOSITY", "info").strip().upper()
    package.setLevel(level if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "INFO")


# ---------------------------------------------------------------------------------------------------- arg types
def _integer(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "an integer >= 0")


def tree_total_tokens(text: str) -> int | str:
    """argparse type: a node count >= 2 (root included) or ``auto`` (any case)."""
    if is_auto(text):
        return "auto"
    return _integer(text, 2, "a number of tree nodes >= 2 (root included) or 'auto'")


def temperature(text: str) -> float:
    """argparse type: a temperature >= 0 (0 = greedy)."""
    value = _float(text, "a temperature >= 0 (0 = greedy)")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a temperature >= 0 (0 = greedy), got {value}")
    return value


def probability(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = _float(text, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


def _float(text: str, what: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def int_list(text: str, minimum: int = 1) -> list[int]:
    """argparse type: comma-separated integers >= 1."""
    values = [_integer(part, minimum, f"comma-separated integers >= {minimum}") for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {minimum}, got {text!r}")
    return values


def tree_total_tokens_list(text: str) -> list[int | str]:
    """argparse type: comma-separated node counts (>= 2) or ``auto``."""
    values = [tree_total_tokens(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated node counts or 'auto', got {text!r}")
    return values


def set_types(parser: argparse.ArgumentParser, **types) -> None:
    """Give already registered options (by dest) a stricter argparse type, leaving their definition in place."""
    for action in parser._actions:
        if action.dest in types:
            action.type = types[action.dest]
