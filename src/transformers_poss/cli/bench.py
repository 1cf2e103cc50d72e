"""`poss bench`: options, assembling the methods, running them (see docs/benchmarking.md)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from ..bench.methods import (GenerationSettings, assistant_method, baseline_method, draft_method,
                             prompt_lookup_method)
from ..bench.run import (build_report, bundled_questions, finish, load_questions, make_prompts, partial_note,
                         render, run_methods)
from ..bench.runtime import environment
from ..checks import check_device, check_writable, require_local_path
from .errors import (int_list, non_negative_int, positive_int, probability, temperature, tree_total_tokens,
                     tree_total_tokens_list)
from .loaders import DTYPES, load_draft, load_target, quantized, uses_chat_template

_int_list, _total_tokens, _total_tokens_list = int_list, tree_total_tokens, tree_total_tokens_list  # older names


def check_arguments(args) -> None:
    """Everything `poss bench` can check before loading a model: question files, draft / assistant / target paths,
    the output folder. Numbers are checked by their argparse types."""
    from ..checkpoints.loading import check_draft_source

    for label, source in _labelled(args.draft):
        check_draft_source(source)
    for label, source in _labelled(args.assistant):
        require_local_path(source, "assistant folder")
    require_local_path(args.target, "target folder")
    check_device(args.device, args.quantize)
    if args.output:
        check_writable(args.output)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `poss bench` options."""
    io = parser.add_argument_group("what to measure")
    io.add_argument("--target", default="smollm2-135m-instruct",
                    help="embedded name (smollm2-135m-instruct, gemma3-270m), Hub id or folder")
    io.add_argument("--draft", action="append", default=[], metavar="[LABEL=]PATH",
                    help="PosS / EAGLE / HASS draft (folder or Hub id); repeat to compare several in one run")
    io.add_argument("--assistant", action="append", default=[], metavar="[LABEL=]PATH",
                    help="small causal LM sharing the target's tokenizer, run as a chain assistant")
    io.add_argument("--questions", nargs="+", default=None, metavar="FILE",
                    help="question files, one JSON object a line, the prompt in turns[0] (default: the bundled "
                         "MT-Bench questions, 80 in 8 categories)")
    io.add_argument("--num-prompts", type=positive_int, default=10, help="prompts per question file (default 10)")
    io.add_argument("--selection", choices=["spread", "first"], default="spread",
                    help="'spread': round-robin over categories (default); 'first': file order")
    io.add_argument("--output", default="poss-bench.json", help="JSON report; plots are written next to it")
    io.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    io.add_argument("--no-progress", action="store_true", help="no progress bars")

    dec = parser.add_argument_group("decoding")
    dec.add_argument("--max-new-tokens", type=positive_int, default=128)
    dec.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy (outputs must equal the baseline)")
    dec.add_argument("--top-p", type=probability, default=None)
    dec.add_argument("--top-k", type=non_negative_int, default=None)
    dec.add_argument("--seed", type=int, default=0)
    dec.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                     help="'auto': use the tokenizer's chat template unless the target is a base model")

    tree = parser.add_argument_group("tree shape (defaults: each draft's generation_config)")
    tree.add_argument("--tree-depth", type=positive_int, default=None)
    tree.add_argument("--tree-top-k", type=positive_int, default=None)
    tree.add_argument("--tree-total-tokens", type=tree_total_tokens, default=None,
                      help="nodes verified per round, root included, or 'auto' (chosen per round from the measured "
                           "cost of verification on this machine)")
    tree.add_argument("--tree-sampling", choices=["draft", "target_only", "draft_probabilities", "both"],
                      default="draft",
                      help="acceptance rule when sampling (tree_sampling): the draft's own setting (default), "
                           "target_only, draft_probabilities (children drawn from the draft, recursive rejection), "
                           "or both (each draft twice, LABEL+draft-probs; not with context candidates or 'auto')")
    tree.add_argument("--context-candidates", choices=["draft", "off", "on", "both"], default="draft",
                      help="continuations copied from the context in the draft's trees (tree_context_candidates): "
                           "the draft's own setting (default), off, on, or both (each draft twice, LABEL+context on)")
    tree.add_argument("--sweep", action="store_true",
                      help="run every draft at every depth x total-tokens shape, and as a chain (top-k 1) of "
                           "each depth")
    tree.add_argument("--sweep-depths", type=int_list, default=[3, 4, 6], metavar="D1,D2,...")
    tree.add_argument("--sweep-total-tokens", type=tree_total_tokens_list, default=[8, 16, 32, 60], metavar="N1,N2,...",
                      help="node counts to sweep; 'auto' adds the automatic budget at each depth, and the summary "
                           "then compares it with the best fixed shape")
    tree.add_argument("--no-sweep-chains", action="store_true",
                      help="leave the chains (top-k 1, depth d, d + 1 tokens) out of the sweep")

    batch = parser.add_argument_group("batched generation")
    batch.add_argument("--batch-size", type=positive_int, nargs="+", default=None, metavar="B",
                       help="measure plain batched generate vs batched tree speculation at these batch sizes "
                            "(e.g. 1 2 4 8): tokens/s over the batch; the tree budget per row shrinks with B")

    other = parser.add_argument_group("other methods and runtime")
    other.add_argument("--no-prompt-lookup", action="store_true", help="skip transformers' prompt lookup decoding")
    other.add_argument("--prompt-lookup-tokens", type=positive_int, default=10)
    other.add_argument("--prompt-lookup-ngram", type=positive_int, default=2)
    other.add_argument("--warmup", type=non_negative_int, default=1, help="warm-up prompts before timing (default 1)")
    other.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    other.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    other.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    other.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager", "poss_exact"])
    other.add_argument("--quantize", choices=["none", "int8"], default="none",
                       help="int8: int8 weights with per-token integer activations and exact attention for the target, "
                            "drafts and assistants (CPU only); every method, "
                            "the baseline included, then runs on the same quantized target")


def _labelled(specs: list[str]) -> list[tuple[str, str]]:
    """``LABEL=PATH`` or ``PATH`` (label: the last path component), labels made unique."""
    pairs, seen = [], {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or os.path.exists(spec):
            label, path = Path(spec.rstrip("/")).name or spec, spec
        count = seen.get(label, 0)
        seen[label] = count + 1
        pairs.append((label if count == 0 else f"{label}-{count + 1}", path))
    return pairs


def _sampling_variants(args, draft, context) -> list[tuple[str, str | None]]:
    """``(name suffix, tree_sampling)`` of each variant ``--tree-sampling`` asks for. ``both`` leaves
    draft_probabilities out where the tree is cut after its children are drawn (context candidates), which that mode
    refuses."""
    from ..speculation.sampled_drafter import sampled_trees_conflict

    if args.tree_sampling == "draft":
        return [("", None)]
    if args.tree_sampling != "both":
        return [("", args.tree_sampling)]
    config = draft.generation_config
    copied = context if context is not None else getattr(config, "tree_context_candidates", None)
    refused = sampled_trees_conflict(bool(copied))
    return [("", "target_only")] + ([] if refused else [("+draft-probs", "draft_probabilities")])


def build_methods(args, target) -> list:
    """baseline, prompt lookup, chain assistants, then each draft (at each sweep shape with --sweep)."""
    methods = [baseline_method(target)]
    if not args.no_prompt_lookup:
        methods.append(prompt_lookup_method(target, args.prompt_lookup_tokens, args.prompt_lookup_ngram))
    for label, source in _labelled(args.assistant):
        assistant, _ = load_target(source, dtype=target.dtype, attn_implementation=args.attn_implementation,
                                   device=target.device)
        assistant = quantized(assistant, args.quantize)
        methods.append(assistant_method(f"assistant:{label}", target, assistant, source))
    for label, source in _labelled(args.draft):
        draft = quantized(load_draft(source, target), args.quantize)  # int8 drafts keep their own attention
        variants = {"draft": [(label, None)], "off": [(label, False)], "on": [(label, True)],
                    "both": [(label, False), (f"{label}+context", True)]}[args.context_candidates]
        variants = [(name, context, _sampling_variants(args, draft, context)) for name, context in variants]
        cut = [name for name, _, samplings in variants if args.tree_sampling == "both" and len(samplings) == 1]
        if cut:
            print(f"{', '.join(cut)}: only the target-only rule is measured (draft_probabilities refuses trees "
                  "with context candidates; --context-candidates off measures both rules)", file=sys.stderr)
        if not args.sweep:
            for name, context, samplings in variants:
                for suffix, sampling in samplings:
                    methods.append(draft_method(name + suffix, target, draft, source, args.tree_depth,
                                                args.tree_top_k, args.tree_total_tokens, context=context,
                                                sampling=sampling))
            continue
        for depth in args.sweep_depths:
            for total in args.sweep_total_tokens:
                for name, context, samplings in variants:  # every shape with and / or without context candidates
                    for suffix, sampling in samplings:
                        method = draft_method(f"{name}{suffix}[d={depth},n={total}]", target, draft, source, depth,
                                              args.tree_top_k, total, context=context, sampling=sampling)
                        method.info.update({"sweep": True, "draft": name + suffix})
                        methods.append(method)
        for depth in [] if args.no_sweep_chains else args.sweep_depths:
            method = draft_method(f"{label}[chain d={depth}]", target, draft, source, depth, 1, depth + 1)
            method.info.update({"sweep": True, "draft": label, "chain": True})
            methods.append(method)
    return methods


def settings_record(args, chat: bool, target) -> dict:
    """The report's ``settings`` section."""
    return {
        "target": args.target, "target_class": type(target).__name__, "dtype": args.dtype,
        "attn_implementation": target.config._attn_implementation, "quantize": args.quantize,
        "drafts": dict(_labelled(args.draft)),
        "assistants": dict(_labelled(args.assistant)), "questions": [str(p) for p in args.questions],
        "num_prompts": args.num_prompts, "selection": args.selection, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "greedy": args.temperature <= 0, "top_p": args.top_p, "top_k": args.top_k,
        "seed": args.seed, "threads": torch.get_num_threads(), "warmup": args.warmup, "chat_template": chat,
        "tree": {"depth": args.tree_depth, "top_k": args.tree_top_k, "total_tokens": args.tree_total_tokens},
        "context_candidates": args.context_candidates, "tree_sampling": args.tree_sampling,
        "sweep": {"depths": args.sweep_depths, "total_tokens": args.sweep_total_tokens,
                  "chains": not args.no_sweep_chains} if args.sweep else None,
        "prompt_lookup": None if args.no_prompt_lookup else
        {"num_tokens": args.prompt_lookup_tokens, "max_ngram": args.prompt_lookup_ngram},
        "method_order": "interleaved prompt by prompt, order rotated by one each prompt",
    }


def run(args) -> int:
    """Run `poss bench` with parsed arguments; returns the exit status."""
    import transformers_poss  # noqa: F401  (makes generate() tree-aware)

    from ..generation.validation import is_bit_exact

    args.questions = args.questions or [str(bundled_questions())]
    questions = load_questions(args.questions, args.num_prompts, args.selection)  # checked before any model loads
    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(args.target, dtype=DTYPES[args.dtype],
                                    attn_implementation=args.attn_implementation, device=device)
    target = quantized(target, args.quantize)  # before drafts attach to its embeddings and head
    chat = {"on": True, "off": False}.get(args.chat_template, None)
    if chat is None:
        chat = uses_chat_template(args.target, tokenizer)
    prompts = make_prompts(questions, tokenizer, chat, device)
    if args.batch_size:
        return run_batch_sizes(args, target, tokenizer, prompts, chat, device)
    methods = build_methods(args, target)
    settings = GenerationSettings(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    outcome = {}
    records = run_methods(prompts, methods, settings, seed=args.seed, warmup=args.warmup, device=device,
                          progress=not args.no_progress, outcome=outcome)
    if not records["baseline"]:
        raise ValueError("no prompt completed" + (" before the interruption" if outcome["interrupted"] else
                                                 f": every prompt failed (first: {outcome['failed'][0]['error']})")
                         + "; nothing to report.")
    report = build_report(records, methods, settings_record(args, chat, target), environment(device))
    partial = partial_note(outcome)
    if partial is not None:
        report["partial"] = partial
    print(render(report))
    status = finish(report, args.output, plots=not args.no_plots, greedy=settings.greedy, exact=is_bit_exact(target))
    if partial is not None:
        where = f" in {args.output}" if args.output else ""
        reason = "interrupted" if partial["interrupted"] else f"{len(partial['failed'])} prompt(s) failed"
        print(f"partial report{where}: {partial['completed_prompts']} of {partial['total_prompts']} prompts "
              f"({reason})", file=sys.stderr)
        return status or (130 if partial["interrupted"] else 1)
    return status


def run_batch_sizes(args, target, tokenizer, prompts, chat: bool, device) -> int:
    """`poss bench --batch-size ...`: plain batched generate vs each draft's batched speculation."""
    import json
    import sys

    from ..bench.batched import markdown, methods_summary, run_batched
    from ..generation.validation import is_bit_exact

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    drafts = {label: load_draft(source, target) for label, source in _labelled(args.draft)}
    settings = GenerationSettings(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    shape = {"depth": args.tree_depth, "top_k": args.tree_top_k, "total_tokens": args.tree_total_tokens}
    batched = run_batched(target, prompts, drafts, settings, args.batch_size, 0 if pad is None else pad, shape,
                          seed=args.seed, warmup=args.warmup > 0)
    record = settings_record(args, chat, target)
    record.update(batch_sizes=args.batch_size, prompt_lookup=None,
                  method_order="per batch: baseline then drafts, order reversed every other batch")
    report = {"environment": environment(device), "settings": record, "batched": batched,
              "methods": methods_summary(batched)}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2, default=str))
    print(markdown(batched))
    mismatched = [e for e in batched["results"] if not e["identical_to_baseline"]]
    if settings.greedy and mismatched and not is_bit_exact(target):
        for e in mismatched:
            print(f"{e['method']} at batch size {e['batch_size']}: {e['identical_rows']} of {e['rows']} rows identical "
                  "to the baseline (bfloat16 / float16: identical only up to floating-point near-ties)", file=sys.stderr)
        return 0
    if settings.greedy and mismatched:
        for e in mismatched:
            print(f"GREEDY OUTPUT MISMATCH: {e['method']} at batch size {e['batch_size']}: "
                  f"{e['rows'] - e['identical_rows']} of {e['rows']} rows differ from the baseline", file=sys.stderr)
        return 1
    return 0
