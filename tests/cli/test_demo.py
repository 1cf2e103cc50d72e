"""`poss demo` on the embedded SmolLM2 target with the shipped draft (slow, marked integration)."""

import pytest

from transformers_poss import cli

@pytest.mark.integration
@pytest.mark.parametrize("quantize", ["int8", "none"])
def test_demo_runs_and_is_identical_to_plain_greedy(quantize, capsys):
    pytest.importorskip("gguf")
    status = cli.main(["demo", "--prompt", "Name two colours.", "--max-new-tokens", "12", "--no-stream",
                       "--quantize", quantize])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "outputs identical to plain greedy: 1/1" in out
    assert "tokens/s" in out and "mean acceptance length" in out


@pytest.mark.integration
def test_demo_shows_each_step_and_its_speed_up(capsys):
    pytest.importorskip("gguf")
    status = cli.main(["demo", "--prompt", "Explain what a hash table is.", "--max-new-tokens", "16", "--no-stream"])
    out = capsys.readouterr().out
    assert status == 0, out
    for step in ("plain fp32", "plain int8", "int8 + speculation", "x over fp32", "over plain int8"):
        assert step in out
    assert "rounds that reached it" in out  # position-wise figures with their counts


def test_default_prompts_ask_for_real_answers():
    from transformers_poss.cli.demo import DEMO_PROMPTS

    assert len(DEMO_PROMPTS) >= 3 and not any("in one sentence" in p or "capital" in p for p in DEMO_PROMPTS)


def test_position_figures_carry_counts_and_hide_thin_rates():
    from types import SimpleNamespace

    from transformers_poss.cli.demo import position_line

    stats = SimpleNamespace(position_accepted=[12, 3], position_proposed=[20, 4])
    assert position_line(stats) == "0.60 (12/20), (3/4)"  # 4 rounds: a count, not a rate


def test_a_loss_is_explained_in_one_line():
    from types import SimpleNamespace

    from transformers_poss.cli.demo import loss_reason

    won = SimpleNamespace(fell_back_to_plain=False, mean_acceptance_length=2.0, position_proposed=[30])
    assert loss_reason(won, 1.2) is None
    low = SimpleNamespace(fell_back_to_plain=False, mean_acceptance_length=1.2, position_proposed=[30])
    assert "1.20 tokens per target forward" in loss_reason(low, 0.9)
    short = SimpleNamespace(fell_back_to_plain=False, mean_acceptance_length=1.5, position_proposed=[3])
    assert "only 3 speculative rounds" in loss_reason(short, 0.9)
    handed = SimpleNamespace(fell_back_to_plain=True, mean_acceptance_length=1.1, position_proposed=[4])
    assert "plain decoding" in loss_reason(handed, 0.9) and "\n" not in loss_reason(handed, 0.9)
