"""Every Python example in README.md runs."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples():
    assert _python_blocks(), "README.md should show a runnable Python example"


@pytest.mark.integration
@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_example_runs(index):
    pytest.importorskip("gguf")
    code = _python_blocks()[index]
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "readme_example"})
