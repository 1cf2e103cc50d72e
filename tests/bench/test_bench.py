"""`poss bench` on tiny random models: report layout, interleaving, equality check, statistics and the CLI."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import save_tiny_target, tiny_llama, write_questions

from transformers_poss import cli
from transformers_poss.cli import bench as bench_cli
from transformers_poss.bench import build_report, finish, load_questions, mismatch_report, render, run_methods
from transformers_poss.bench.run import partial_note
from transformers_poss.bench.methods import (GenerationSettings, Method, MethodResult, Prompt, baseline_method,
                                             prompt_lookup_method, record_candidate_rounds, result_from_generate)
from transformers_poss.bench.metrics import (PromptRecord, first_mismatch, position_acceptance, position_reach,
                                             position_rounds,
                                             summarize, time_split)


CONTRACT_KEYS = {"tokens_per_s", "speedup", "mean_acceptance_length", "position_acceptance", "identical_to_baseline",
                 "prompts"}


@pytest.fixture(scope="module")
def model():
    target = tiny_llama(vocab_size=128, hidden_size=32)
    target.generation_config.eos_token_id = None  # always generate the full budget
    return target


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(3)
    # repeated n-grams so prompt lookup has something to find
    rows = []
    for i in range(3):
        base = torch.randint(3, 128, (6,), generator=generator)
        ids = torch.cat([base, base, base[:3]])[None]
        rows.append(Prompt(i, "file_a" if i < 2 else "file_b", f"cat{i % 2}", f"prompt {i}", ids))
    return rows


def broken(model, prompt_index=1, position=2):
    """Baseline decoding with one token flipped on one prompt: what a lossy speculator looks like."""
    base = baseline_method(model)

    def run(prompt, settings):
        result = base.run(prompt, settings)
        if prompt.question_id == prompt_index:
            result.tokens[position] = (result.tokens[position] + 1) % 128
        return result

    return Method("broken", run)


def run_report(model, prompts, methods, tokens=8, **kwargs):
    records = run_methods(prompts, methods, GenerationSettings(tokens), progress=False, warmup=0, **kwargs)
    return build_report(records, methods, {"greedy": True})


def test_report_layout_and_lossless_methods(model, prompts):
    methods = [baseline_method(model), prompt_lookup_method(model, num_tokens=4)]
    report = run_report(model, prompts, methods, tokens=10)
    assert set(report) == {"environment", "settings", "methods"}
    assert list(report["methods"]) == ["baseline", "prompt_lookup"]
    for entry in report["methods"].values():
        assert CONTRACT_KEYS <= set(entry)
        assert entry["prompts"] == 3 and entry["identical_to_baseline"] == 3 and entry["mismatches"] == []
        assert entry["new_tokens"] == 30
        assert set(entry["by_file"]) == {"file_a", "file_b"} and set(entry["by_category"]) == {"cat0", "cat1"}
        assert entry["by_file"]["file_a"]["prompts"] == 2
        assert {"median", "aggregate"} <= set(entry["tokens_per_s"]) | set(entry["speedup"])
    base, lookup = report["methods"]["baseline"], report["methods"]["prompt_lookup"]
    assert base["mean_acceptance_length"] == 1.0 and base["speedup"]["aggregate"] == 1.0
    assert base["position_acceptance"] is None
    # prompt lookup: per-round lengths cover every new token, and the repeated prompts get drafts accepted
    for row in lookup["per_prompt"]:
        assert sum(row["accepted_lengths"]) == row["new_tokens"] == 10
    assert lookup["mean_acceptance_length"] > 1.0
    assert lookup["position_acceptance"] and all(r is None or 0 <= r <= 1 for r in lookup["position_acceptance"])
    assert len(lookup["position_rounds"]) == len(lookup["position_acceptance"])
    # over the rounds that offered a draft (position 1's): they accepted every draft token there is
    accepted = sum(sum(row["accepted_lengths"]) - len(row["accepted_lengths"]) for row in lookup["per_prompt"])
    assert accepted > 0
    assert sum(lookup["position_reach"]) * lookup["position_rounds"][0] == pytest.approx(accepted, rel=1e-3)
    assert mismatch_report(report) == []
    assert "cpu" in report["environment"] and report["environment"]["versions"]["torch"]
    json.dumps(report)  # JSON-ready


def test_chain_assistant_method(model, prompts):
    from transformers_poss.bench.methods import assistant_method

    assistant = tiny_llama(vocab_size=128, hidden_size=16, layers=1, seed=5)
    methods = [baseline_method(model), assistant_method("assistant:tiny", model, assistant, "tiny")]
    entry = run_report(model, prompts[:2], methods, tokens=8)["methods"]["assistant:tiny"]
    assert entry["identical_to_baseline"] == 2 and entry["info"]["kind"] == "chain_assistant"
    assert all(sum(row["accepted_lengths"]) == 8 for row in entry["per_prompt"])
    assert entry["position_acceptance"] is not None


def test_broken_method_is_caught(model, prompts, caplog, capsys):
    methods = [baseline_method(model), broken(model, prompt_index=1, position=2)]
    report = run_report(model, prompts, methods)
    entry = report["methods"]["broken"]
    assert entry["identical_to_baseline"] == 2
    assert entry["mismatches"] == [{"question_id": 1, "file": "file_a", "first_mismatch": 2}]
    assert finish(report, None, greedy=True) == 1
    assert [r.levelname for r in caplog.records if "GREEDY OUTPUT MISMATCH" in r.getMessage()] == ["ERROR"]
    assert capsys.readouterr().out == ""  # the library prints nothing: the command prints render(report)
    assert finish(report, None, greedy=False) == 0  # sampling: differences are expected, not an error


def test_methods_are_interleaved_and_rotated(prompts):
    calls = []

    def recorder(name):
        def run(prompt, settings):
            calls.append((prompt.question_id, name))
            return MethodResult([1] * settings.max_new_tokens)
        return Method(name, run)

    methods = [recorder("baseline"), recorder("a"), recorder("b")]
    records = run_methods(prompts, methods, GenerationSettings(4), progress=False, warmup=1)
    warm, timed = calls[:3], calls[3:]
    assert warm == [(0, "baseline"), (0, "a"), (0, "b")]
    assert [q for q, _ in timed] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [n for _, n in timed] == ["baseline", "a", "b", "a", "b", "baseline", "b", "baseline", "a"]
    assert all(r.identical for rs in records.values() for r in rs)


def test_run_methods_needs_a_baseline(prompts):
    with pytest.raises(ValueError, match="baseline"):
        run_methods(prompts, [Method("x", lambda p, s: MethodResult([]))], GenerationSettings(2), progress=False)


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 5, 3], [1, 2, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def _record(result, seconds=1.0):
    return PromptRecord(Prompt(0, "f", "c", "", torch.zeros(1, 2, dtype=torch.long)), result, seconds)


def test_position_acceptance_pooling():
    # rounds offering 3 positions: accepted 0, 1, 2, 3 drafts (x 6: 24 rounds, 18 reach position 3)
    rounds = _record(MethodResult([0] * 10, accepted_lengths=[1, 2, 3, 4] * 6, drafted_lengths=[3, 3, 3, 3] * 6))
    assert position_acceptance([rounds]) == [0.75, pytest.approx(2 / 3, abs=1e-4), 0.5]
    assert position_rounds([rounds]) == [24, 18, 12]
    # at least i drafts accepted, over all 24 rounds: the shares sum to the mean accepted drafts per round (1.5)
    assert position_reach([rounds]) == [0.75, 0.5, 0.25] and sum(position_reach([rounds])) == pytest.approx(1.5)
    # exact counts are summed over prompts before dividing
    a = _record(MethodResult([0], position_counts=([10, 0], [20, 10])))
    b = _record(MethodResult([0], position_counts=([30, 20, 10], [40, 30, 20])))
    assert position_acceptance([a, b]) == [pytest.approx(4 / 6, abs=1e-4), 0.5, 0.5]
    assert position_reach([a, b]) == [pytest.approx(40 / 60, abs=1e-4), pytest.approx(20 / 60, abs=1e-4),
                                      pytest.approx(10 / 60, abs=1e-4)]
    assert position_reach([_record(MethodResult([0]))]) is None
    assert position_acceptance([_record(MethodResult([0]))]) is None


def test_position_reached_by_too_few_rounds_has_no_rate():
    record = _record(MethodResult([0], position_counts=([12, 3, 1], [20, 9, 1])))
    assert position_acceptance([record]) == [0.6, None, None]  # 9 and 1 rounds: below MIN_POSITION_ROUNDS
    assert position_rounds([record]) == [20, 9, 1]


def test_time_split_other_is_the_rest():
    records = [_record(MethodResult([0], time_split={"drafting": 0.5, "verification": 1.0}), seconds=2.0),
               _record(MethodResult([0]), seconds=5.0)]
    split = time_split(records)
    assert split["seconds"] == {"drafting": 0.5, "verification": 1.0, "other": 0.5}
    assert split["share"]["verification"] == 0.5


def test_result_from_tree_generate_output():
    stats = SimpleNamespace(accepted_lengths=[3, 1, 2], position_acceptance=[0.5, 0.5], position_accepted=[2, 1],
                            position_proposed=[4, 2], timings={"drafting": 0.1, "verification": 0.2})
    output = SimpleNamespace(sequences=torch.tensor([[7, 8, 1, 2, 3, 4, 5, 6]]), acceptance=stats)
    result = result_from_generate(output, prompt_length=2)
    assert result.tokens == [1, 2, 3, 4, 5, 6] and result.accepted_lengths == [3, 1, 2]
    assert result.position_counts == ([2, 1], [4, 2]) and result.time_split["verification"] == 0.2
    assert result.drafted_lengths is None  # no tree depths reported


def test_mean_draft_depth_counts_drafting_rounds_only():
    # two tree rounds of depth 2 and 1, then two plain steps after a fallback (depth 0)
    stats = SimpleNamespace(accepted_lengths=[3, 1, 1, 1], tree_depths=[2, 1, 0, 0], position_acceptance=[0.5],
                            position_accepted=[1], position_proposed=[2], timings={})
    output = SimpleNamespace(sequences=torch.tensor([[7, 8, 1, 2, 3, 4, 5, 6, 9]]), acceptance=stats)
    result = result_from_generate(output, prompt_length=2)
    assert result.drafted_lengths == [2, 1, 0, 0]
    record = _record(result)
    assert summarize([record], [record])["mean_draft_depth"] == 1.5
    assert summarize([_record(MethodResult([0, 1]))], [record])["mean_draft_depth"] is None


def test_candidate_round_recording_leaves_model_untouched(model, prompts):
    with record_candidate_rounds(model) as rounds:
        model.generate(prompts[0].input_ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=3)
    assert rounds and all(0 <= accepted <= offered for offered, accepted in rounds)
    assert "_get_candidate_generator" not in vars(model)


def test_load_questions(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "ab"[i // 3], "turns": [f"question {i}", "second turn"]} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    spread = load_questions([path], num_prompts=4)
    assert [q["question_id"] for q in spread] == [0, 3, 1, 4]
    assert spread[0]["text"] == "question 0" and spread[0]["file"] == "q"
    assert [q["question_id"] for q in load_questions([path], 2, "first")] == [0, 1]
    assert len(load_questions([path, path], num_prompts=5)) == 10
    path.write_text(json.dumps({"question_id": 1}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        load_questions([path])


# ------------------------------------------------------------------------------------------------------ command line
@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory, model):
    """A folder holding the tiny model and a word-level tokenizer with a chat template."""
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"), model)


def test_cli_bench_end_to_end(tiny_target_dir, tmp_path, capsys):
    q1, q2 = write_questions(tmp_path / "one.jsonl", 3, "x"), write_questions(tmp_path / "two.jsonl", 2, "y")
    out = tmp_path / "report.json"
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--questions", q1, q2, "--num-prompts", "2",
                       "--max-new-tokens", "6", "--seed", "1", "--threads", "1", "--output", str(out),
                       "--no-progress"])
    assert status == 0
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["baseline", "prompt_lookup"]
    assert report["settings"]["chat_template"] is True and report["settings"]["threads"] == 1
    assert report["settings"]["max_new_tokens"] == 6 and report["settings"]["greedy"] is True
    assert set(report["methods"]["baseline"]["by_file"]) == {"one", "two"}
    assert report["methods"]["prompt_lookup"]["identical_to_baseline"] == 4
    assert (tmp_path / "report.speedup.png").stat().st_size > 0
    assert "| baseline |" in capsys.readouterr().out


def test_bundled_mt_bench_questions_ship_with_the_package():
    from fnmatch import fnmatch
    from pathlib import Path

    from conftest import MT_BENCH
    from transformers_poss.bench import bundled_questions

    path = bundled_questions()
    questions = load_questions([path], selection="first")
    assert len(questions) == 80 and len({q["category"] for q in questions}) == 8 and questions[0]["file"] == "mt_bench"
    assert [q["question_id"] for q in load_questions([path], 8)] == [81, 91, 101, 111, 121, 131, 141, 151]  # spread
    assert path.read_bytes() == MT_BENCH.read_bytes()
    assert "Apache License 2.0" in (path.parent / "README.md").read_text()  # its source and licence, next to it
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = root / "src" / "transformers_poss" / "bench"
    assert path.resolve() == (package / "data" / "mt_bench.jsonl").resolve()
    for name in ("data/mt_bench.jsonl", "data/README.md"):  # both go into the wheel
        assert any(fnmatch(name, pattern) for pattern in patterns["transformers_poss.bench"]), name


def test_cli_bench_runs_the_bundled_questions_without_questions(tiny_target_dir, tmp_path, capsys):
    from transformers_poss.bench import bundled_questions

    out = tmp_path / "report.json"
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--num-prompts", "2", "--max-new-tokens", "3",
                       "--no-prompt-lookup", "--no-progress", "--warmup", "0", "--output", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    assert report["settings"]["questions"] == [str(bundled_questions())]
    baseline = report["methods"]["baseline"]
    assert baseline["prompts"] == 2 and set(baseline["by_file"]) == {"mt_bench"}
    assert {row["category"] for row in baseline["per_prompt"]} == {"writing", "roleplay"}
    err = capsys.readouterr().err
    assert f"[poss bench] plot: {tmp_path / 'report.speedup.png'}" in err  # the library's log, shown by the command
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert "bundled MT-Bench" in " ".join(capsys.readouterr().out.split())


def test_cli_bench_with_a_draft_folder(tiny_target_dir, model, tmp_path):
    from helpers import tiny_draft

    tiny_draft(model).save_pretrained(tmp_path / "draft")
    q = write_questions(tmp_path / "q.jsonl", 2, "x")
    out = tmp_path / "r.json"
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--questions", q, "--max-new-tokens", "6",
                       "--draft", f"mine={tmp_path / 'draft'}", "--tree-depth", "2", "--tree-total-tokens", "4",
                       "--no-prompt-lookup", "--no-plots", "--no-progress", "--output", str(out)])
    report = json.loads(out.read_text())
    assert status == 0 and list(report["methods"]) == ["baseline", "mine"]
    assert report["methods"]["mine"]["identical_to_baseline"] == 2
    assert report["methods"]["mine"]["info"]["tree"]["depth"] == 2
    assert report["settings"]["drafts"] == {"mine": str(tmp_path / "draft")}


def test_cli_bench_int8_target(tiny_target_dir, tmp_path, monkeypatch):
    from transformers_poss.quantization import int8 as quantize

    quantized = []
    original = quantize.apply_quantization
    monkeypatch.setattr(quantize, "apply_quantization", lambda m, mode: quantized.append(mode) or original(m, mode))
    q = write_questions(tmp_path / "q.jsonl", 2, "x")
    out = tmp_path / "r.json"
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--questions", q, "--max-new-tokens", "6",
                       "--quantize", "int8", "--no-plots", "--no-progress", "--output", str(out)])
    report = json.loads(out.read_text())
    assert status == 0 and report["settings"]["quantize"] == "int8" and quantized == ["int8"]
    assert report["methods"]["prompt_lookup"]["identical_to_baseline"] == 2


def test_cli_bench_exits_non_zero_on_mismatch(tiny_target_dir, tmp_path, monkeypatch, capsys):
    original = bench_cli.build_methods
    monkeypatch.setattr(bench_cli, "build_methods",
                        lambda args, target: original(args, target) + [broken(target, prompt_index=0, position=0)])
    q = write_questions(tmp_path / "q.jsonl", 2, "x")
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--questions", q, "--max-new-tokens", "4",
                       "--no-prompt-lookup", "--no-plots", "--no-progress", "--output", str(tmp_path / "r.json")])
    assert status == 1
    assert "broken: 1 of 2 outputs differ" in capsys.readouterr().err


def test_cli_bench_sampling_does_not_demand_equality(tiny_target_dir, tmp_path, monkeypatch):
    original = bench_cli.build_methods
    monkeypatch.setattr(bench_cli, "build_methods",
                        lambda args, target: original(args, target) + [broken(target, prompt_index=0, position=0)])
    q = write_questions(tmp_path / "q.jsonl", 2, "x")
    out = tmp_path / "r.json"
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--questions", q, "--max-new-tokens", "4",
                       "--temperature", "0.8", "--top-p", "0.9", "--no-plots", "--no-progress", "--output", str(out)])
    report = json.loads(out.read_text())
    assert status == 0 and report["settings"]["greedy"] is False
    assert report["methods"]["broken"]["identical_to_baseline"] < 2


def test_cli_help_lists_the_contract_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--target", "--draft", "--questions", "--num-prompts", "--max-new-tokens", "--temperature", "--seed",
                 "--threads", "--output", "--tree-depth", "--tree-top-k", "--tree-total-tokens", "--sweep"):
        assert flag in text
    assert cli.main([]) == 2


def test_cli_generate(tiny_target_dir, capsys):
    status = cli.main(["generate", "--target", str(tiny_target_dir), "--max-new-tokens", "5", "w1 w2 w3"])
    assert status == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "tokens/s" in captured.err


def test_draft_labels():
    assert bench_cli._labelled(["drafts/a/", "x=drafts/b", "other/a"]) == [
        ("a", "drafts/a/"), ("x", "drafts/b"), ("a-2", "other/a")]


# ------------------------------------------------------------------------------------------ PosS tree speculation
def test_tree_draft_method_and_sweep(model, prompts, monkeypatch, tmp_path):
    from helpers import tiny_draft

    monkeypatch.setenv("POSS_CACHE", str(tmp_path))  # the automatic budget measures and caches a cost profile

    from transformers_poss.bench.methods import draft_method

    draft = tiny_draft(model)
    own_shape = (draft.generation_config.tree_depth, draft.generation_config.tree_total_tokens)
    methods = [baseline_method(model), draft_method("poss", model, draft, "tiny", depth=3, top_k=3, total_tokens=6)]
    for depth, total in ((2, 4), (3, 8), (3, "auto")):
        method = draft_method(f"poss[d={depth},n={total}]", model, draft, "tiny", depth, 2, total)
        method.info.update({"sweep": True, "draft": "poss"})
        methods.append(method)
    report = run_report(model, prompts[:2], methods, tokens=8)
    for name, entry in report["methods"].items():
        assert entry["identical_to_baseline"] == 2, name  # lossless
    entry = report["methods"]["poss"]
    assert entry["info"]["tree"] == {"depth": 3, "top_k": 3, "total_tokens": 6}
    for row in entry["per_prompt"]:  # rounds cover every new token except the one from the prefill forward
        assert row["new_tokens"] - 1 <= sum(row["accepted_lengths"]) <= row["new_tokens"] == 8
    assert entry["mean_acceptance_length"] >= 1.0
    assert 1 <= len(entry["position_acceptance"]) <= 3
    assert {"drafting", "verification", "other"} <= set(entry["time_split"]["seconds"])
    assert (draft.generation_config.tree_depth, draft.generation_config.tree_total_tokens) == own_shape
    shapes = report["sweep"]["shapes"]
    assert [(s["depth"], s["total_tokens"]) for s in shapes] == [(2, 4), (3, 8), (3, "auto")]
    assert [s["plain_share"] for s in shapes[:2]] == [0.0, 0.0]  # fixed shapes never fall back to plain decoding
    fixed = [s for s in shapes if s["total_tokens"] != "auto"]
    assert report["sweep"]["best"]["poss"]["speedup"] == max(s["speedup"] for s in fixed)
    auto = report["sweep"]["auto_vs_best"]["poss"]
    assert auto["auto"] == "poss[d=3,n=auto]"
    assert auto["ratio"] == auto["auto_speedup"] / max(s["speedup"] for s in fixed)
    assert "auto" in render(report)
    assert bench_cli._total_tokens_list("8,auto,16") == [8, "auto", 16]


def test_cli_bench_batch_sizes(tiny_target_dir, model, tmp_path, capsys):
    from helpers import tiny_draft

    tiny_draft(model).save_pretrained(tmp_path / "draft")
    q = write_questions(tmp_path / "q.jsonl", 3, "x")
    out = tmp_path / "r.json"
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--questions", q, "--max-new-tokens", "6",
                       "--draft", f"mine={tmp_path / 'draft'}", "--tree-depth", "2", "--tree-total-tokens", "8", "--tree-top-k", "2",
                       "--batch-size", "1", "2", "--no-progress", "--output", str(out)])
    report = json.loads(out.read_text())
    assert status == 0 and report["settings"]["batch_sizes"] == [1, 2]
    rows = {(e["batch_size"], e["method"]): e for e in report["batched"]["results"]}
    assert set(rows) == {(1, "baseline"), (1, "mine"), (2, "baseline"), (2, "mine")}
    assert rows[(2, "mine")]["batches"] == 2 and rows[(2, "mine")]["identical_rows"] == 3
    assert rows[(1, "mine")]["tree_total_tokens_per_row"] == 8 and rows[(2, "mine")]["tree_total_tokens_per_row"] == 4
    assert all(e["tokens_per_s"] > 0 for e in rows.values())
    assert report["methods"]["mine"]["identical_to_baseline"] == 6
    assert "| 2 | mine |" in capsys.readouterr().out


def test_plain_decoding_after_a_fallback_is_reported(model, prompts, monkeypatch):
    """A machine where no tree can pay: the automatic budget falls back after its warm-up rounds, and the report (and
    the table's "plain %" column) says how much of the method's time and tokens were plain decoding; methods that
    never fall back report 0 and "-"."""
    from helpers import tiny_draft

    from transformers_poss.bench.methods import draft_method
    from transformers_poss.generation import budget as budget_module
    from transformers_poss.generation.budget import CostProfile

    expensive = CostProfile(key="k", verify_seconds={1: 1.0, 64: 2.0}, draft_context_seconds=50.0,
                            draft_step_seconds=50.0)
    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: expensive)
    draft = tiny_draft(model)
    methods = [baseline_method(model), draft_method("auto", model, draft, "tiny", 2, 2, "auto"),
               draft_method("fixed", model, draft, "tiny", 2, 2, 4)]
    # 8 warm-up rounds, two probes and a fresh probe before the decision: long enough answers to see the hand-over
    report = run_report(model, prompts[:2], methods, tokens=20)
    entry = report["methods"]["auto"]
    assert entry["identical_to_baseline"] == 2  # lossless across the hand-over
    plain = entry["plain_decoding"]
    assert plain["prompts"] == 2 and plain["tokens"] == sum(r["plain_tokens"] for r in entry["per_prompt"])
    assert plain["tokens"] >= 2 and plain["token_share"] == round(plain["tokens"] / entry["new_tokens"], 4)
    assert 0 < plain["seconds"] <= entry["seconds"]
    # both seconds are rounded to 0.1 ms in the report: allow for that in their quotient
    rounding = 1e-4 * (1 + plain["share"]) / entry["seconds"]
    assert plain["share"] == pytest.approx(plain["seconds"] / entry["seconds"], abs=1e-3 + rounding)
    assert plain["seconds"] == entry["time_split"]["seconds"]["plain_decoding"]
    assert all(r["plain_tokens"] >= 1 and r["plain_decoding_seconds"] > 0 for r in entry["per_prompt"])
    for name in ("baseline", "fixed"):
        assert report["methods"][name]["plain_decoding"] == {"seconds": 0.0, "share": 0.0, "tokens": 0,
                                                             "token_share": 0.0, "prompts": 0}
    assert report["methods"]["fixed"]["per_prompt"][0]["plain_tokens"] == 0  # tree speculation, never fell back
    assert report["methods"]["baseline"]["per_prompt"][0]["plain_tokens"] is None  # no budget at all
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in render(report).splitlines() if line.startswith("| ")}
    column = rows["method"].index("plain %")
    assert rows["auto"][column] == f"{plain['share']:.0%}"
    assert rows["baseline"][column] == rows["fixed"][column] == "-"


def _scripted(name, fail_on=None, interrupt_on=None):
    def run(prompt, settings):
        if prompt.question_id == fail_on:
            raise RuntimeError(f"out of memory on question {fail_on}")
        if prompt.question_id == interrupt_on:
            raise KeyboardInterrupt
        return MethodResult([1] * settings.max_new_tokens)
    return Method(name, run)


def test_a_failing_prompt_is_left_out_and_named(prompts, caplog):
    outcome = {}
    methods = [_scripted("baseline"), _scripted("a", fail_on=1)]
    records = run_methods(prompts, methods, GenerationSettings(4), progress=False, warmup=0, outcome=outcome)
    assert [r.prompt.question_id for r in records["baseline"]] == [0, 2] == [r.prompt.question_id for r in records["a"]]
    assert outcome["completed"] == 2 and outcome["total"] == 3 and not outcome["interrupted"]
    assert outcome["failed"] == [{"question_id": 1, "method": "a", "error": "out of memory on question 1"}]
    assert any("prompt 1 failed with a" in r.getMessage() for r in caplog.records)
    assert partial_note(outcome)["completed_prompts"] == 2


def test_an_interrupted_run_keeps_the_complete_prompts(prompts):
    outcome = {}
    methods = [_scripted("baseline"), _scripted("a", interrupt_on=2)]
    records = run_methods(prompts, methods, GenerationSettings(4), progress=False, warmup=0, outcome=outcome)
    assert len(records["baseline"]) == len(records["a"]) == 2
    assert outcome["interrupted"] and outcome["completed"] == 2
    complete = {"completed": 3, "total": 3, "failed": [], "interrupted": False}
    assert partial_note(complete) is None


def test_cli_bench_writes_a_partial_report_and_says_so(tiny_target_dir, tmp_path, monkeypatch, capsys):
    from transformers_poss.bench import run as bench_run

    questions = write_questions(tmp_path / "q.jsonl", 3, "x")
    out = tmp_path / "report.json"
    original = bench_run.timed_run

    def interrupted(method, prompt, *args, **kwargs):
        if prompt.question_id == 2:
            raise KeyboardInterrupt
        return original(method, prompt, *args, **kwargs)

    monkeypatch.setattr(bench_run, "timed_run", interrupted)
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--questions", questions, "--num-prompts", "3",
                       "--max-new-tokens", "4", "--threads", "1", "--output", str(out), "--no-progress",
                       "--no-plots", "--no-prompt-lookup"])
    assert status == 130
    report = json.loads(out.read_text())
    assert report["partial"]["completed_prompts"] == 2 and report["partial"]["interrupted"]
    assert "partial report" in capsys.readouterr().err


def test_cli_bench_sweep_runs_each_shape_with_and_without_context_candidates(tiny_target_dir, model, tmp_path):
    from helpers import tiny_draft

    tiny_draft(model).save_pretrained(tmp_path / "draft")
    q = write_questions(tmp_path / "q.jsonl", 2, "x")
    out = tmp_path / "r.json"
    status = cli.main(["bench", "--target", str(tiny_target_dir), "--questions", q, "--max-new-tokens", "6",
                       "--draft", f"mine={tmp_path / 'draft'}", "--sweep", "--sweep-depths", "2",
                       "--sweep-total-tokens", "4", "--no-sweep-chains", "--context-candidates", "both",
                       "--no-prompt-lookup", "--no-plots", "--no-progress", "--output", str(out)])
    methods = json.loads(out.read_text())["methods"]
    assert status == 0 and list(methods) == ["baseline", "mine[d=2,n=4]", "mine+context[d=2,n=4]"]
    assert methods["mine+context[d=2,n=4]"]["info"]["context_candidates"] is True
    assert methods["mine[d=2,n=4]"]["info"]["context_candidates"] is False
    assert all(entry["identical_to_baseline"] == 2 for entry in methods.values())


def test_cli_bench_compares_both_tree_sampling_modes_when_sampling(tiny_target_dir, model, tmp_path, capsys):
    from helpers import tiny_draft

    tiny_draft(model).save_pretrained(tmp_path / "draft")
    q = write_questions(tmp_path / "q.jsonl", 2, "x")
    out = tmp_path / "r.json"
    common = ["bench", "--target", str(tiny_target_dir), "--questions", q, "--max-new-tokens", "6",
              "--draft", f"mine={tmp_path / 'draft'}", "--tree-total-tokens", "5", "--tree-sampling", "both",
              "--temperature", "1", "--seed", "3", "--no-prompt-lookup", "--no-plots", "--no-progress"]
    status = cli.main(common + ["--output", str(out)])
    methods = json.loads(out.read_text())["methods"]
    assert status == 0 and list(methods) == ["baseline", "mine", "mine+draft-probs"]
    assert methods["mine"]["info"]["tree_sampling"] == "target_only"
    assert methods["mine+draft-probs"]["info"]["tree_sampling"] == "draft_probabilities"
    # the automatic budget shapes sampled trees before drawing: both rules are measured there too
    status = cli.main(common[:-9] + ["--tree-total-tokens", "auto", "--tree-sampling", "both", "--temperature", "1",
                                     "--no-prompt-lookup", "--no-plots", "--no-progress", "--output", str(out)])
    assert status == 0 and list(json.loads(out.read_text())["methods"]) == ["baseline", "mine", "mine+draft-probs"]
    # context candidates cut the merged tree after drawing: only the target-only rule is measured there
    status = cli.main(common[:-9] + ["--tree-total-tokens", "5", "--context-candidates", "on", "--tree-sampling",
                                     "both", "--temperature", "1", "--no-prompt-lookup", "--no-plots", "--no-progress",
                                     "--output", str(out)])
    assert status == 0 and list(json.loads(out.read_text())["methods"]) == ["baseline", "mine"]
    assert "mine: only the target-only rule is measured" in capsys.readouterr().err
