"""`poss bench`: acceptance and speed of speculative decoding methods, measured side by side on one target.

Every method runs on every prompt, interleaved prompt by prompt (the order rotates from prompt to prompt), so drift
of a shared machine hits all methods alike. In a bit-exact setting (float32, the int8 exact path) greedy outputs must
equal the baseline token for token; any difference is reported loudly and makes the command exit with status 1. In
bfloat16 / float16 (identical only up to floating-point near-ties) the share of identical outputs and the mean
tokens before the first difference are reported instead.

Library use::

    records = run_methods(prompts, [baseline_method(model), my_method], GenerationSettings(max_new_tokens=64))
    report = build_report(records, methods, settings={...})
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers.utils import logging

from .methods import (GenerationSettings, Method, Prompt, assistant_method, baseline_method, draft_method,
                      prompt_lookup_method)
from .metrics import (ACCEPTANCE_CONVENTION, PromptRecord, category_table, compare_with_baseline, markdown_table,
                      method_report, plain_percent, source_table)
from .runtime import PeakMemory, environment, synchronize


logger = logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------------------- prompts
def bundled_questions() -> Path:
    """The MT-Bench questions shipped with the package (80 questions, 10 per category; FastChat's copy, Apache-2.0,
    see ``bench/data/README.md``): what `poss bench` runs on without ``--questions``."""
    from importlib.resources import files

    return Path(str(files(__package__) / "data" / "mt_bench.jsonl"))


def load_questions(paths, num_prompts: int | None = None, selection: str = "spread") -> list[dict]:
    """Read question files (one JSON object a line, the prompt in ``turns[0]``).

    Args:
        paths: question files; each is reported under its file stem.
        num_prompts: prompts taken from EACH file (None = all).
        selection: ``"spread"`` takes questions round-robin over categories so a few prompts cover every category;
            ``"first"`` takes them in file order.
    """
    if num_prompts is not None and (isinstance(num_prompts, bool) or not isinstance(num_prompts, int)
                                    or num_prompts < 1):
        raise ValueError(f"num_prompts must be an integer >= 1 (or None for all), got {num_prompts!r}")
    questions = []
    for path in map(Path, paths):
        rows = []
        for number, row in _question_rows(path):
            rows.append({"question_id": row.get("question_id", number), "category": row.get("category", "all"),
                         "text": row["turns"][0], "file": path.stem})
        if not rows:
            raise ValueError(f"{path}: no questions (one JSON object a line, the prompt in turns[0])")
        if selection == "spread":
            rows = _round_robin(rows)
        questions.extend(rows if num_prompts is None else rows[:num_prompts])
    return questions


def _question_rows(path: Path):
    """``(line number, question)`` of a question file, each checked: a JSON object with a non-empty text turns[0]."""
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} {'is a folder' if path.is_dir() else 'does not exist'}")
    from ..textfiles import read_lines

    for number, line in read_lines(path):  # plain or gzip-compressed; a non-UTF-8 line is named
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a question must be a JSON object with a 'turns' list")
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{path}:{number}: a question needs a non-empty 'turns' list")
        if not isinstance(turns[0], str) or not turns[0].strip():
            raise ValueError(f"{path}:{number}: turns[0] must be the prompt text, got {turns[0]!r:.40}")
        yield number, row


def _round_robin(rows: list[dict]) -> list[dict]:
    """Reorder rows so categories alternate (first appearance order), keeping file order inside a category."""
    by_category = defaultdict(list)
    for row in rows:
        by_category[row["category"]].append(row)
    queues = list(by_category.values())
    ordered = []
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


def encode_prompt(tokenizer, text: str, chat: bool, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `text`, through the chat template (generation prompt added) when `chat`."""
    if chat:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_dict=True, return_tensors="pt")
    else:
        encoded = tokenizer(text, return_tensors="pt")
    input_ids = encoded["input_ids"]
    mask = encoded.get("attention_mask", torch.ones_like(input_ids))
    return input_ids.to(device), mask.to(device)


def make_prompts(questions: list[dict], tokenizer, chat: bool, device=None) -> list[Prompt]:
    """Tokenize questions for the target."""
    prompts = []
    for q in questions:
        ids, mask = encode_prompt(tokenizer, q["text"], chat, device)
        prompts.append(Prompt(q["question_id"], q["file"], q["category"], q["text"], ids, mask))
    return prompts


# ------------------------------------------------------------------------------------------------------------ running
def timed_run(method: Method, prompt: Prompt, settings: GenerationSettings, seed: int, device=None) -> PromptRecord:
    """Run one method on one prompt: wall-clock time (device synchronized) and peak memory around the call."""
    torch.manual_seed(seed)
    with PeakMemory(device) as memory:
        synchronize(device)
        start = time.perf_counter()
        result = method.run(prompt, settings)
        synchronize(device)
        seconds = time.perf_counter() - start
    return PromptRecord(prompt, result, seconds, _round(memory.peak_mb), _round(memory.delta_mb))


def _round(value, digits=1):
    return None if value is None else round(value, digits)


def warm_up(prompts: list[Prompt], methods: list[Method], settings: GenerationSettings, tokens: int = 16) -> None:
    """Run every method untimed on the warm-up prompts with a short budget (allocators, kernels, caches)."""
    short = dataclasses.replace(settings, max_new_tokens=min(tokens, settings.max_new_tokens))
    for prompt in prompts:
        for method in methods:
            method.run(prompt, short)


def run_methods(prompts: list[Prompt], methods: list[Method], settings: GenerationSettings, seed: int = 0,
                warmup: int = 1, device=None, progress: bool = True,
                outcome: dict | None = None) -> dict[str, list[PromptRecord]]:
    """Run all methods on all prompts, interleaved prompt by prompt, and compare each with the baseline.

    The method order rotates by one per prompt so no method is always first (or always after another). The method
    named ``baseline`` is the reference for equality and speed-up. Each call starts from the same seed.
    Progress: transformers' tqdm (off with ``progress=False`` or transformers' progress-bar switch).

    A prompt on which a method fails is left out for every method (the error is logged and listed), and an
    interruption (Ctrl-C) stops the run after the last complete prompt: the records then hold the complete prompts
    only, and ``outcome`` (a dict, filled in when given) says ``completed`` / ``total`` prompts, the ``failed`` ones
    (question id, method, error) and whether the run was ``interrupted``.
    """
    names = [m.name for m in methods]
    if "baseline" not in names or len(set(names)) != len(names):
        raise ValueError(f"method names must be unique and include 'baseline', got {names}")
    outcome = {} if outcome is None else outcome
    outcome.update(completed=0, total=len(prompts), failed=[], interrupted=False)
    if warmup:
        warm_up(prompts[:warmup], methods, settings)
    records = {name: [] for name in names}
    bar = logging.tqdm(total=len(prompts) * len(methods), desc="poss bench", unit="run", disable=not progress)
    try:
        for index, prompt in enumerate(prompts):
            shift = index % len(methods)
            done = len(records["baseline"])
            method = None
            try:
                for method in methods[shift:] + methods[:shift]:
                    record = timed_run(method, prompt, settings, seed + index, device)
                    records[method.name].append(record)
                    bar.set_postfix_str(f"q{prompt.question_id} {method.name}: {record.tokens_per_s:.1f} tok/s")
                    bar.update()
            except Exception as error:  # one prompt failing: keep the others, say which and why
                for name in names:
                    del records[name][done:]
                message = " ".join(str(error).split())[:300] or type(error).__name__
                outcome["failed"].append({"question_id": prompt.question_id, "method": method.name, "error": message})
                logger.error("prompt %s failed with %s (%s); it is left out of the report", prompt.question_id,
                             method.name, message)
                continue
            reference = records["baseline"][-1]
            for name in names:
                compare_with_baseline(records[name][-1], reference)
            outcome["completed"] += 1
    except KeyboardInterrupt:
        done = outcome["completed"]
        for name in names:
            del records[name][done:]
        outcome["interrupted"] = True
        logger.warning("interrupted: the report holds the %d prompt(s) completed before", done)
    finally:
        bar.close()
    return records


def partial_note(outcome: dict) -> dict | None:
    """The report's ``partial`` entry when not every prompt completed (None when all did)."""
    if outcome.get("completed") == outcome.get("total") and not outcome.get("failed"):
        return None
    return {"completed_prompts": outcome["completed"], "total_prompts": outcome["total"],
            "interrupted": outcome["interrupted"], "failed": outcome["failed"]}


# ------------------------------------------------------------------------------------------------------------- report
def build_report(records: dict[str, list[PromptRecord]], methods: list[Method], settings: dict,
                 env: dict | None = None) -> dict:
    """The JSON report: ``{"environment", "settings", "methods": {NAME: {...}}}`` (+ ``"sweep"`` for sweeps)."""
    baseline = records["baseline"]
    report = {
        "environment": env if env is not None else environment(),
        "settings": {**settings, "acceptance_convention": ACCEPTANCE_CONVENTION},
        "methods": {m.name: method_report(records[m.name], baseline, m.info) for m in methods},
    }
    shaped = {name: entry for name, entry in report["methods"].items() if entry["info"].get("sweep")}
    if shaped:
        report["sweep"] = sweep_summary(shaped)
    return report


def sweep_summary(methods: dict) -> dict:
    """Speed-up per tree shape, best shape per draft."""
    rows = []
    for name, entry in methods.items():
        tree = entry["info"]["tree"]
        rows.append({"method": name, "draft": entry["info"]["draft"], "depth": tree["depth"],
                     "total_tokens": tree["total_tokens"], "top_k": tree["top_k"],
                     "speedup": entry["speedup"]["aggregate"], "speedup_median": entry["speedup"]["median"],
                     "mean_acceptance_length": entry["mean_acceptance_length"],
                     "mean_draft_depth": entry.get("mean_draft_depth"),
                     "plain_share": entry["plain_decoding"]["share"]})
    best, auto = {}, {}
    for row in rows:
        if row["speedup"] is None:
            continue
        chosen = auto if row["total_tokens"] == "auto" else best
        if row["draft"] not in chosen or row["speedup"] > chosen[row["draft"]]["speedup"]:
            chosen[row["draft"]] = row
    summary = {"shapes": rows, "best": best}
    if auto:  # the automatic budget (its best depth) against the best fixed shape of the same draft
        summary["auto_vs_best"] = {
            draft: {"auto": row["method"], "auto_speedup": row["speedup"], "best": best[draft]["method"],
                    "best_speedup": best[draft]["speedup"], "ratio": row["speedup"] / best[draft]["speedup"]}
            for draft, row in auto.items() if draft in best
        }
    return summary


def mismatch_report(report: dict) -> list[str]:
    """Lines describing every method whose greedy output differs from the baseline (empty when all agree)."""
    lines = []
    for name, entry in report["methods"].items():
        if entry["identical_to_baseline"] < entry["prompts"]:
            where = ", ".join(f"q{m['question_id']}@{m['first_mismatch']}" for m in entry["mismatches"])
            lines.append(f"{name}: {entry['prompts'] - entry['identical_to_baseline']} of {entry['prompts']} outputs "
                         f"differ from the baseline (question@first differing token: {where})")
    return lines


def render(report: dict) -> str:
    """Markdown for stdout: the method table, speed-up per category, and the sweep when there is one."""
    parts = [markdown_table(report["methods"]), "", category_table(report["methods"])]
    if source_table(report["methods"]):  # context candidates: tokens and rounds per source
        parts += ["", source_table(report["methods"])]
    if len(report["methods"]["baseline"]["by_file"]) > 1:
        parts += ["", category_table(report["methods"], "by_file")]
    if "sweep" in report:
        parts += ["", "| draft | depth | top-k | total tokens | speed-up | mean acc. length | mean draft depth "
                  "| plain % |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        parts += [f"| {r['draft']} | {r['depth']} | {r['top_k']} | {r['total_tokens']} | {r['speedup']:.2f}x "
                  f"| {r['mean_acceptance_length']} | {r.get('mean_draft_depth')} "
                  f"| {plain_percent(r.get('plain_share'))} |"
                  for r in report["sweep"]["shapes"]]
        for draft, row in report["sweep"].get("auto_vs_best", {}).items():
            parts.append(f"\n{draft}: auto {row['auto_speedup']:.2f}x vs best fixed shape {row['best']} "
                         f"{row['best_speedup']:.2f}x (ratio {row['ratio']:.2f})")
    parts += ["", f"Acceptance: {ACCEPTANCE_CONVENTION}."]
    return "\n".join(parts)


def near_tie_agreement(entry: dict) -> dict:
    """How close a method's greedy outputs are to the baseline's where they may differ at floating-point near-ties:
    the share of identical outputs and the mean number of tokens before the first difference (a whole output
    counts for an identical one)."""
    rows = entry.get("per_prompt") or []
    before = [r["new_tokens"] if r["identical_to_baseline"] else r["first_mismatch"] for r in rows]
    prompts = entry["prompts"]
    return {"identical_share": round(entry["identical_to_baseline"] / prompts, 4) if prompts else None,
            "mean_tokens_before_first_difference": round(sum(before) / len(before), 2) if before else None}


def finish(report: dict, output: str | None, plots: bool = True, greedy: bool = True, exact: bool = True) -> int:
    """Write the report (and plots), log what is wrong with the outputs, and return the exit status.

    ``exact``: the setting is bit-exact (float32, the int8 exact path), so a greedy mismatch is a failure (status 1,
    logged as an error). Otherwise (bfloat16 / float16) outputs are identical only up to floating-point near-ties:
    each method's entry gets ``near_tie_agreement`` (share of identical outputs, mean tokens before the first
    difference), logged as a warning, and the status stays 0. The Markdown table is `render(report)`; the command
    prints it.
    """
    report["settings"]["bit_exact"] = exact
    if greedy and not exact:
        for entry in report["methods"].values():
            entry["near_tie_agreement"] = near_tie_agreement(entry)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=2, default=str))
        logger.info("report: %s", output)
        if plots:
            from .plots import save_plots

            for path in save_plots(report, output):
                logger.info("plot: %s", path)
    problems = mismatch_report(report)
    if greedy and problems and not exact:
        logger.warning(
            "Not bit-exact in this setting (bfloat16 / float16: identical only up to floating-point near-ties; "
            "use float32 or --quantize int8 for bit-exact output):"
            + "".join(f"\n  {name}: {entry['near_tie_agreement']['identical_share']:.0%} identical, "
                      f"{entry['near_tie_agreement']['mean_tokens_before_first_difference']} tokens on average "
                      "before the first difference" for name, entry in report["methods"].items()))
        return 0
    if greedy and problems:
        banner = "!" * 100
        logger.error(f"{banner}\nGREEDY OUTPUT MISMATCH: lossless speculative decoding must reproduce the baseline "
                     "exactly." + "".join(f"\n  {line}" for line in problems) + f"\n{banner}")
        return 1
    return 0


__all__ = ["GenerationSettings", "Method", "Prompt", "assistant_method", "baseline_method", "build_report",
           "bundled_questions", "draft_method", "encode_prompt", "finish", "load_questions", "make_prompts",
           "prompt_lookup_method", "run_methods", "timed_run"]
