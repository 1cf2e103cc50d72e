"""PNG plots of the `poss bench` and `poss tune` reports: which files are written (fixture reports, end to end)."""

import json

import pytest

from helpers import save_tiny_target, tiny_draft, tiny_llama, write_questions
from transformers_poss import cli
from transformers_poss.bench.plots import save_plots, save_tune_plot

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def _method(speedup, positions=None):
    return {"speedup": {"aggregate": speedup, "median": speedup}, "position_acceptance": positions}


def _shape(draft, depth, total, speedup, tau, top_k=4):
    return {"method": f"{draft}[d={depth},n={total}]", "draft": draft, "depth": depth, "total_tokens": total,
            "top_k": top_k, "speedup": speedup, "mean_acceptance_length": tau, "plain_share": 0.0}


def sweep_report():
    """A `poss bench --sweep` report as `build_report` writes it: two drafts, two depths, chains, the auto budget."""
    shapes = []
    for draft in ("poss", "eagle"):
        shapes += [_shape(draft, d, n, 0.8 + 0.01 * n, 1.2 + 0.1 * d) for d in (2, 4) for n in (4, 8, 16)]
        shapes += [_shape(draft, d, d + 1, 0.9, 1.3, top_k=1) for d in (2, 4)]  # chains
        shapes.append(_shape(draft, 4, "auto", 0.97, 1.4))
    methods = {"baseline": _method(1.0)}
    methods.update({s["method"]: _method(s["speedup"], [0.6, 0.4]) for s in shapes})
    return {"settings": {"target": "tiny", "greedy": True}, "methods": methods, "sweep": {"shapes": shapes}}


def tune_report():
    """A `poss tune --output` report: profile, candidates (trees and chains), the chosen shape, its measurement."""
    candidates = [{"kind": "tree", "depth": d, "top_k": 3, "total_tokens": n, "mean_acceptance_length": 1.5,
                   "predicted_speedup": 1.2 - 0.01 * n - 0.02 * d} for d in (1, 2, 3) for n in (2, 4, 8)]
    candidates += [{"kind": "chain", "depth": d, "top_k": 1, "total_tokens": d + 1, "mean_acceptance_length": 1.3,
                    "predicted_speedup": 1.1 - 0.03 * d} for d in (1, 2, 3)]
    candidates.sort(key=lambda r: r["predicted_speedup"], reverse=True)
    profile = {"key": "k", "verify_seconds": {"1": 0.010, "2": 0.018, "4": 0.020, "8": 0.031},
               "draft_context_seconds": 0.002, "draft_step_seconds": 0.001, "meta": {}}
    return {"target": "tiny", "draft": "d", "profile": profile, "chain_profile": profile, "candidates": candidates,
            "chosen": candidates[0], "measured": {"speedup": 1.05, "mean_acceptance_length": 1.4}}


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == PNG


def test_sweep_report_gets_a_sweep_plot(tmp_path):
    paths = save_plots(sweep_report(), tmp_path / "bench.json")
    names = sorted(p.name for p in paths)
    assert names == ["bench.position_acceptance.png", "bench.speedup.png", "bench.sweep.png"]
    assert all(_is_png(p) for p in paths)
    report = sweep_report()
    del report["sweep"]
    assert not any(p.name.endswith("sweep.png") for p in save_plots(report, tmp_path / "plain.json"))


def test_tune_report_gets_a_cost_curve_plot(tmp_path):
    path = save_tune_plot(tune_report(), tmp_path / "tune.json")
    assert path == tmp_path / "tune.cost_curve.png" and _is_png(path)


def test_cli_bench_sweep_writes_its_plot_next_to_the_report(tmp_path, capsys):
    target = tiny_llama(vocab_size=128, hidden_size=32)
    target.generation_config.eos_token_id = None
    folder = save_tiny_target(tmp_path / "target", target)
    tiny_draft(target).save_pretrained(tmp_path / "draft")
    argv = ["bench", "--target", str(folder), "--questions", write_questions(tmp_path / "q.jsonl", 1, "x"),
            "--max-new-tokens", "4", "--draft", f"mine={tmp_path / 'draft'}", "--sweep", "--sweep-depths", "1,2",
            "--sweep-total-tokens", "3,4", "--tree-top-k", "2", "--no-prompt-lookup", "--no-progress", "--warmup", "0"]
    assert cli.main(argv + ["--output", str(tmp_path / "out" / "sweep.json")]) == 0
    report = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert {(s["depth"], s["total_tokens"]) for s in report["sweep"]["shapes"]} == {(1, 3), (1, 4), (2, 3), (2, 4),
                                                                                   (1, 2), (2, 3)}
    assert _is_png(tmp_path / "out" / "sweep.sweep.png") and _is_png(tmp_path / "out" / "sweep.speedup.png")
    assert f"plot: {tmp_path / 'out' / 'sweep.sweep.png'}" in capsys.readouterr().err
    assert cli.main(argv + ["--output", str(tmp_path / "quiet" / "sweep.json"), "--no-plots"]) == 0
    assert sorted(p.name for p in (tmp_path / "quiet").iterdir()) == ["sweep.json"]
