"""poss bench inputs: question files are checked line by line; near-tie agreement in bfloat16 / float16."""

import pytest
import torch

from helpers import tiny_llama


def test_bench_reports_near_tie_agreement_instead_of_failing(caplog):
    from test_bench import broken, run_report

    from transformers_poss.bench import finish
    from transformers_poss.bench.methods import Prompt, baseline_method

    model = tiny_llama(vocab_size=128, hidden_size=32)
    model.generation_config.eos_token_id = None
    prompts = [Prompt(i, "f", "c", "p", torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(i)))
               for i in range(4)]
    methods = [baseline_method(model), broken(model, prompt_index=1, position=3)]
    report = run_report(model, prompts, methods, tokens=8)
    assert finish(report, None, greedy=True, exact=False) == 0  # bf16 / fp16: reported, not a failure
    agreement = report["methods"]["broken"]["near_tie_agreement"]
    assert agreement == {"identical_share": 0.75, "mean_tokens_before_first_difference": (8 * 3 + 3) / 4}
    assert report["methods"]["baseline"]["near_tie_agreement"]["identical_share"] == 1.0
    assert report["settings"]["bit_exact"] is False
    logged = caplog.text  # a warning of the bench's logger, not a print
    assert "Not bit-exact in this setting" in logged and "broken: 75% identical" in logged
    assert finish(report, None, greedy=True, exact=True) == 1  # float32 / int8 exact path: a mismatch fails


# ---------------------------------------------------------------------------------------------------- bench inputs
@pytest.mark.parametrize("content, problem", [
    ('{"turns": ["a"]}\n{oops\n', ":2: not valid JSON"),
    ('{"question_id": 1}\n', ":1: a question needs a non-empty 'turns' list"),
    ('{"turns": [3]}\n', r":1: turns\[0\] must be the prompt text"),
    ('["a"]\n', ":1: a question must be a JSON object"),
    ("\n\n", ": no questions"),
])
def test_bad_question_files(tmp_path, content, problem):
    from transformers_poss.bench import load_questions

    path = tmp_path / "q.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path}{problem}"):
        load_questions([path])


def test_question_file_missing_and_bad_count(tmp_path):
    from transformers_poss.bench import load_questions

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_questions([tmp_path / "nope.jsonl"])
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["a"]}\n{"turns": ["b"]}\n')
    with pytest.raises(ValueError, match="num_prompts must be an integer >= 1"):
        load_questions([path], num_prompts=-1)


# ---------------------------------------------------------------------------------------------------- train recipe
