"""`poss tune`: choose the tree shape for this machine.

1. Measures (once, cached) the target's verification cost curve t(n) and the draft's step times.
2. Records a few generations with a large tree (every round's tree and accepted path).
3. Replays the recorded rounds under every candidate shape with the measured costs: trees (depth x total tokens at
   the draft's top-k) and chains (top-k 1, depth d, d + 1 tokens: the top-1 path of each recorded tree, drafted at the
   measured top-k 1 step times); picks the shape with the highest predicted speed-up and says whether a chain or a
   tree won; speculation that would not pay is reported as such.
4. Measures the chosen shape against plain decoding, interleaved prompt by prompt, and prints predicted vs measured.
5. Draws the cost curve t(n) and the predicted speed-up of every shape (the chosen one marked) as a PNG next to the
   ``--output`` report (``<stem>.cost_curve.png``; ``poss-tune.cost_curve.png`` without ``--output``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import torch

from .errors import positive_int

DEPTHS = (1, 2, 3, 4, 5, 6, 7, 8)
SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def add_arguments(parser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct", help="embedded name, Hub id or folder")
    parser.add_argument("--draft", required=True, help="draft folder or Hub id")
    parser.add_argument("--questions", nargs="*", default=None,
                        help="question files (mt_bench.jsonl format); default: the demo prompts")
    parser.add_argument("--num-prompts", type=positive_int, default=4)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--top-k", type=positive_int, default=None, help="tree top-k (default: the draft's)")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--refresh", action="store_true", help="measure the cost curve again")
    parser.add_argument("--save", action="store_true", help="write the chosen shape into the draft folder")
    parser.add_argument("--output", default=None, help="write the tuning report (JSON) here")
    parser.add_argument("--no-plots", action="store_true",
                        help="do not draw the cost curve (<output stem>.cost_curve.png, or poss-tune.cost_curve.png)")


def _prompts(args, tokenizer, chat):
    from .loaders import encode_prompt

    texts = _texts(args)
    return [encode_prompt(tokenizer, t, chat) for t in texts[: args.num_prompts]]


def _texts(args) -> list[str]:
    """The prompt texts: the question files' turns[0] (checked line by line), else the demo prompts."""
    from ..bench.run import load_questions
    from .demo import DEMO_PROMPTS

    if not args.questions:
        return list(DEMO_PROMPTS)
    return [q["text"] for q in load_questions(args.questions, selection="first")]


def check_arguments(args) -> None:
    """Everything `poss tune` can check before loading a model."""
    from ..checks import check_writable, require_local_path
    from ..checkpoints.loading import check_draft_source

    _texts(args)
    require_local_path(args.target, "target folder")
    check_draft_source(args.draft)
    if args.save and not os.path.isdir(args.draft):
        raise ValueError(f"--save writes the chosen shape into the draft folder, but {args.draft} is not a local "
                         "folder.")
    if args.output or not args.no_plots:  # the plot goes next to the report (or poss-tune.cost_curve.png here)
        check_writable(args.output or "poss-tune.json")


def record_rounds(target, draft, prompts, max_new_tokens, depth, top_k, total):
    """Generate greedily with a large tree and return every round's [`RoundRecord`]."""
    from ..bench.methods import tree_shape

    records = []
    with tree_shape(draft, depth, top_k, total):
        draft.generation_config.tree_record_rounds = True
        try:
            for ids, mask in prompts:
                out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=draft, do_sample=False,
                                      max_new_tokens=max_new_tokens, return_dict_in_generate=True)
                records += out.acceptance.rounds
        finally:
            draft.generation_config.tree_record_rounds = False
    return records


def measure(target, draft, prompts, max_new_tokens, shape):
    """Median per-prompt speed-up of ``shape`` over plain greedy, interleaved; also the mean acceptance length."""
    from ..bench.methods import tree_shape

    ratios, taus = [], []
    for ids, mask in prompts:
        kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
        start = time.perf_counter()
        plain = target.generate(**kwargs)
        t_plain = time.perf_counter() - start
        with tree_shape(draft, shape["depth"], shape.get("top_k"), shape["total_tokens"]):
            start = time.perf_counter()
            spec = target.generate(**kwargs, assistant_model=draft, return_dict_in_generate=True)
            t_spec = time.perf_counter() - start
        if not torch.equal(plain, spec.sequences):
            raise RuntimeError("speculative output differs from plain greedy decoding")
        ratios.append(t_plain / t_spec)
        taus.append(spec.acceptance.mean_acceptance_length)
    return statistics.median(ratios), statistics.mean(taus)


def candidate_shapes(records, profile, chain_profile, top_k: int) -> list[dict]:
    """Every candidate shape replayed on ``records``, best predicted speed-up first: trees at ``top_k`` (depth x total
    tokens) and chains (top-k 1) of every depth, the latter costed with ``chain_profile``'s drafting times."""
    from ..generation.budget import simulate_shape

    results = []
    if top_k > 1:
        results += [simulate_shape(records, profile, d, n, top_k) for d in DEPTHS for n in SIZES
                    if n <= 1 + top_k * d * top_k]
    results += [simulate_shape(records, chain_profile, d, d + 1, top_k=1) for d in DEPTHS]
    results.sort(key=lambda r: r["predicted_speedup"], reverse=True)
    return results


def chain_costs(profile, draft):
    """``profile`` with the drafting times of a top-k 1 proposer (a chain step drafts one node, not top_k)."""
    from ..generation.budget import measure_draft_seconds

    context, step = measure_draft_seconds(draft, top_k=1)
    return dataclasses.replace(profile, draft_context_seconds=context, draft_step_seconds=step,
                               meta={**profile.meta, "top_k": 1})


PREDICTION_TOLERANCE = 0.10  # a measured speed-up further than this from the prediction gets an explanation


def prediction_gap(predicted: float, measured: float, predicted_tau: float, measured_tau: float) -> str | None:
    """One line on why the measured speed-up is more than ``PREDICTION_TOLERANCE`` away from the prediction, split
    into its two factors (speed-up = acceptance length / cost of a round in decode steps): how much of the gap is
    acceptance (the prediction replays the recorded large trees cut to this shape; the shape's own rounds build
    their trees themselves) and how much is cost (the profile's round cost against what the measured rounds
    implied). None when within."""
    if predicted <= 0 or measured <= 0 or abs(measured / predicted - 1) <= PREDICTION_TOLERANCE:
        return None
    acceptance = measured_tau / predicted_tau if predicted_tau > 0 else 1.0
    cost = acceptance / (measured / predicted)  # measured round cost / predicted round cost
    reasons = []
    if abs(acceptance - 1) > 0.03:
        reasons.append(f"the acceptance length was {acceptance:.2f}x the replayed one ({measured_tau:.2f} against "
                       f"{predicted_tau:.2f}: the shape's own rounds accept differently than its replay from the "
                       "recorded large trees)")
    if abs(cost - 1) > 0.03:
        reasons.append(f"a round cost {cost:.2f}x what the cost profile predicts (other load on the machine while "
                       "measuring, or a profile measured under other conditions: `poss tune` again re-measures it)")
    return (f"measured {measured:.2f}x is {abs(measured / predicted - 1):.0%} from the predicted {predicted:.2f}x: "
            + ("; ".join(reasons) if reasons else "both factors are within 3% and compound"))


def round_cost_line(profile, depth: int, top_k: int, total: int) -> str:
    """One round (drafting ``depth`` levels, verifying ``total`` nodes) against one decode step, from ``profile``."""
    step, draft, verify = profile.verify(1), profile.draft(depth), profile.verify(total)
    return (f"one round (depth {depth}, top-k {top_k}, {total} nodes) = drafting {draft * 1000:.1f} ms + verifying "
            f"{verify * 1000:.1f} ms = {(draft + verify) / step:.2f}x a decode step (verification alone "
            f"{verify / step:.2f}x); it pays from an acceptance length of {(draft + verify) / step:.2f}")


def run(args) -> int:
    import transformers_poss  # noqa: F401

    from ..generation.budget import load_or_measure_profile
    from .loaders import load_draft, load_target, quantized, uses_chat_template

    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target)
    target = quantized(target, args.quantize)
    draft = quantized(load_draft(args.draft, target), args.quantize)
    top_k = args.top_k or draft.generation_config.tree_top_k
    prompts = _prompts(args, tokenizer, uses_chat_template(args.target, tokenizer))
    profile = load_or_measure_profile(target, draft, top_k=top_k, refresh=args.refresh)
    print("verification cost t(n)/t(1): " + ", ".join(f"{n}: {r:.2f}" for n, r in profile.curve().items()))
    print(f"t(1) = {profile.verify(1) * 1000:.1f} ms; draft context step {profile.draft_context_seconds * 1000:.1f} ms,"
          f" further step {profile.draft_step_seconds * 1000:.1f} ms")
    print(round_cost_line(profile, draft.generation_config.tree_depth, top_k, 16))

    # warm-up, then record with the largest shape considered
    ids, mask = prompts[0]
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=draft)
    records = record_rounds(target, draft, prompts, args.max_new_tokens, max(DEPTHS), top_k, max(SIZES))
    chain_profile = chain_costs(profile, draft)
    print(f"chain (top-k 1): draft context step {chain_profile.draft_context_seconds * 1000:.1f} ms, further step "
          f"{chain_profile.draft_step_seconds * 1000:.1f} ms")
    results = candidate_shapes(records, profile, chain_profile, top_k)
    print(f"\n{len(records)} recorded rounds; best predicted shapes (trees: top-k {top_k}; chains: top-k 1):")
    print("| kind | depth | top-k | total tokens | predicted acceptance length | predicted speed-up |\n"
          "|---|---:|---:|---:|---:|---:|")
    for r in results[:8]:
        print(f"| {r['kind']} | {r['depth']} | {r['top_k']} | {r['total_tokens']} | {r['mean_acceptance_length']:.2f} "
              f"| {r['predicted_speedup']:.2f}x |")
    best = results[0]
    best_chain = next(r for r in results if r["kind"] == "chain")
    best_tree = next((r for r in results if r["kind"] == "tree"), None)
    print(f"best chain: depth {best_chain['depth']} at {best_chain['predicted_speedup']:.2f}x; best tree: "
          + (f"depth {best_tree['depth']}, {best_tree['total_tokens']} nodes at {best_tree['predicted_speedup']:.2f}x"
             if best_tree else "none (top-k 1)") + f" -> a {best['kind']} wins")
    report = {"target": args.target, "draft": args.draft, "profile": json.loads(profile.to_json()),
              "chain_profile": json.loads(chain_profile.to_json()), "candidates": results, "chosen": best}
    if best["predicted_speedup"] < 1.0:
        print(f"\nNo shape (tree or chain) is predicted to beat plain decoding here "
              f"(best {best['predicted_speedup']:.2f}x): "
              "use plain generate, or tree_total_tokens='auto', which falls back to plain decoding by itself.")
    measured, tau = measure(target, draft, prompts, args.max_new_tokens, best)
    report["measured"] = {"speedup": measured, "mean_acceptance_length": tau}
    print(round_cost_line(profile if best["kind"] == "tree" else chain_profile, best["depth"], best["top_k"],
                          best["total_tokens"]))
    print(f"\nchosen: {best['kind']}, depth {best['depth']}, top-k {best['top_k']}, {best['total_tokens']} nodes -> "
          f"predicted {best['predicted_speedup']:.2f}x (acceptance length {best['mean_acceptance_length']:.2f}), "
          f"measured {measured:.2f}x (acceptance length {tau:.2f})")
    gap = prediction_gap(best["predicted_speedup"], measured, best["mean_acceptance_length"], tau)
    report["measured"]["prediction_gap"] = gap
    if gap:
        print(f"why the prediction missed: {gap}")
    if args.save:
        draft.generation_config.tree_depth = best["depth"]
        draft.generation_config.tree_top_k = best["top_k"]
        draft.generation_config.tree_total_tokens = best["total_tokens"]
        draft.generation_config.save_pretrained(args.draft)
        print(f"saved the shape to {args.draft}/generation_config.json")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    if not args.no_plots:
        from ..bench.plots import save_tune_plot

        path = save_tune_plot(report, args.output or "poss-tune.json")
        if path is not None:
            print(f"cost curve plot: {path}")
    return 0
