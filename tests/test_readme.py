"""Every code block in README.md and docs/*.md runs, or says why it does not.

A block runs unless the line right before its opening fence is ``<!-- not-run: REASON -->`` (an install command, a
multi-minute job, the Hub, a GPU server, a diagram or sample output). Runnable blocks are ``python`` (executed),
``bash`` (executed by bash -e in a scratch folder where ``drafts/`` points at the shipped drafts) and ``yaml``
(parsed). Python blocks in docs/ are fragments: they run after `PRELUDE` (the names README's quick start defines).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = ("python", "bash", "yaml")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
MARKER = re.compile(r"<!-- not-run: (.+?) -->\s*$")

# what a docs fragment may assume: a target, its tokenizer, the shipped draft and one chat prompt
PRELUDE = """
import torch
import transformers_poss
from transformers_poss import PosSDraftModel
from transformers_poss.embedded import load_target, shipped_draft

target, tokenizer = load_target("smollm2-135m-instruct")
draft = PosSDraftModel.from_pretrained(shipped_draft())
messages = [{"role": "user", "content": "Name three rivers in Europe."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
"""


def _blocks(page):
    """``(language, code, not-run reason or None, line)`` of every fenced block of ``page``."""
    text = page.read_text(encoding="utf-8")
    out = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        line = text[: match.start()].count("\n") + 1
        out.append((match.group(1), match.group(2), marker.group(1) if marker else None, line))
    return out


def _cases(language):
    return [
        pytest.param(page, code, id=f"{page.relative_to(ROOT)}:{line}")
        for page in PAGES
        for lang, code, reason, line in _blocks(page)
        if lang == language and reason is None
    ]


def _python_blocks():  # README's (kept for other tests)
    return [code for lang, code, reason, _ in _blocks(README) if lang == "python" and reason is None]


def test_readme_has_examples():
    assert _python_blocks(), "README.md should show a runnable Python example"


def test_every_block_runs_or_is_marked():
    unmarked = [f"{page.relative_to(ROOT)}:{line} ({lang or 'no language'})"
                for page in PAGES for lang, code, reason, line in _blocks(page)
                if reason is None and (lang not in RUNNABLE or not code.strip())]
    assert not unmarked, f"blocks neither runnable nor marked <!-- not-run: reason -->: {unmarked}"


def test_no_page_needs_files_outside_the_checkout():
    for page in PAGES:
        assert "../shared" not in page.read_text(encoding="utf-8"), page


@pytest.mark.parametrize("page, code", _cases("yaml"))
def test_yaml_block_parses(page, code):
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(code) is not None


@pytest.mark.integration
@pytest.mark.parametrize("page, code", _cases("python"))
def test_python_block_runs(page, code, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    (tmp_path / "drafts").symlink_to(ROOT / "drafts")
    monkeypatch.chdir(tmp_path)  # files a block writes land in a scratch folder
    source = code if page == README else PRELUDE + code
    exec(compile(source, f"{page.name} block", "exec"), {"__name__": "docs_example"})


@pytest.mark.integration
@pytest.mark.parametrize("page, code", _cases("bash"))
def test_bash_block_runs(page, code, tmp_path):
    pytest.importorskip("gguf")
    (tmp_path / "drafts").symlink_to(ROOT / "drafts")
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               POSS_NO_PROGRESS="1")
    result = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
