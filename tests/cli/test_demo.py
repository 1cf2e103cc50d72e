"""`poss demo` on the embedded SmolLM2 target with the shipped draft (slow, marked integration)."""

import pytest

from transformers_poss import cli

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("quantize", ["int8", "none"])
def test_demo_runs_and_is_identical_to_plain_greedy(quantize, capsys):
    pytest.importorskip("gguf")
    status = cli.main(["demo", "--prompt", "Name two colours.", "--max-new-tokens", "12", "--no-stream",
                       "--quantize", quantize])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "outputs identical to plain greedy: 1/1" in out
    assert "tokens/s" in out and "mean acceptance length" in out
