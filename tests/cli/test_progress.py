"""One switch for every progress bar: `poss --no-progress`, POSS_NO_PROGRESS=1, or a stderr that is no terminal."""

import io

from transformers.utils import logging as hf_logging

from transformers_poss.cli import errors


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_flag_env_and_non_terminal_turn_bars_off(monkeypatch):
    monkeypatch.delenv("POSS_NO_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", _Tty())
    assert errors.take_no_progress_flag(["demo"]) == (["demo"], False)
    assert errors.take_no_progress_flag(["demo", "--no-progress"]) == (["demo"], True)
    monkeypatch.setenv("POSS_NO_PROGRESS", "1")
    assert errors.take_no_progress_flag(["demo"]) == (["demo"], True)
    monkeypatch.delenv("POSS_NO_PROGRESS")
    monkeypatch.setattr("sys.stderr", io.StringIO())  # captured: no carriage-return bars in the log
    assert errors.take_no_progress_flag(["demo"]) == (["demo"], True)


def test_commands_switch_bars_off_and_back(monkeypatch):
    monkeypatch.delenv("POSS_NO_PROGRESS", raising=False)
    hf_logging.enable_progress_bar()
    restore = errors.disable_progress_bars()
    assert not hf_logging.is_progress_bar_enabled()  # transformers' "Loading weights" and the library's bars
    restore()
    assert hf_logging.is_progress_bar_enabled()


def test_importing_the_library_leaves_bars_alone():
    import subprocess
    import sys

    code = "import transformers_poss; from transformers.utils import logging; print(logging.is_progress_bar_enabled())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
