"""`poss demo`: tree speculation with the shipped draft on the embedded SmolLM2 target, side by side with plain
greedy decoding.

Streams the speculative answers as they are accepted, then prints plain vs speculative tokens/s, the speed-up, the
mean acceptance length and whether every output is token-identical to plain greedy decoding.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .errors import positive_int

DEFAULT_DRAFT = "poss-smollm2-135m-instruct"
DEMO_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is to a beginner programmer.",
)


def shipped_draft_path(name: str = DEFAULT_DRAFT) -> Path | None:
    """The shipped draft folder (installed with the package; ``$POSS_DRAFTS/NAME`` first), or None."""
    from ..targets.embedded import shipped_draft

    try:
        return shipped_draft(name)
    except FileNotFoundError:
        return None


def add_arguments(parser) -> None:
    parser.add_argument("--draft", default=None, help=f"draft folder (default: {DEFAULT_DRAFT}, shipped with the package)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="embedded name, Hub id or folder")
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable); default: three built-in")
    parser.add_argument("--max-new-tokens", type=positive_int, default=96)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--quantize", choices=["none", "int8"], default="int8",
                        help="int8 (default): the lossless CPU fast path for target and draft, plain decoding included "
                             "(docs/budget.md); none: float32")
    parser.add_argument("--no-stream", action="store_true", help="do not stream the answers")


def check_arguments(args, draft: str) -> None:
    """Everything `poss demo` can check before loading a model."""
    from ..checks import require_local_path
    from ..checkpoints.loading import check_draft_source

    if args.prompt is not None and not all(p.strip() for p in args.prompt):
        raise ValueError("--prompt is empty: give the prompt text.")
    require_local_path(args.target, "target folder")
    check_draft_source(draft)


def _time(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(args) -> int:
    import transformers_poss  # noqa: F401  (makes generate() tree-aware)
    from transformers import TextStreamer

    from .loaders import encode_prompt, load_draft, load_target, quantized, uses_chat_template

    if args.threads:
        torch.set_num_threads(args.threads)
    draft_path = args.draft or shipped_draft_path()
    if draft_path is None:
        print(f"No draft found: the shipped {DEFAULT_DRAFT} is not installed; pass --draft FOLDER.", file=sys.stderr)
        return 2
    check_arguments(args, str(draft_path))
    print(f"target: {args.target}   draft: {draft_path}", flush=True)
    target, tokenizer = load_target(args.target)
    target = quantized(target, args.quantize)
    draft = quantized(load_draft(str(draft_path), target), args.quantize)
    gen = draft.generation_config
    print(f"tree: depth {gen.tree_depth}, top-k {gen.tree_top_k}, {gen.tree_total_tokens} nodes; "
          f"threads {torch.get_num_threads()}\n", flush=True)
    chat = uses_chat_template(args.target, tokenizer)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    # warm-up, untimed
    ids, mask = encode_prompt(tokenizer, "Hello!", chat)
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=draft)

    rows, identical = [], 0
    for prompt in args.prompt or DEMO_PROMPTS:
        ids, mask = encode_prompt(tokenizer, prompt, chat)
        print(f"> {prompt}", flush=True)
        streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        spec, t_spec = _time(lambda: target.generate(input_ids=ids, attention_mask=mask, assistant_model=draft,
                                                     streamer=streamer, return_dict_in_generate=True, **kwargs))
        plain, t_plain = _time(lambda: target.generate(input_ids=ids, attention_mask=mask, **kwargs))
        if args.no_stream:
            print(tokenizer.decode(spec.sequences[0, ids.shape[1]:], skip_special_tokens=True))
        same = torch.equal(spec.sequences, plain)
        identical += same
        new = spec.sequences.shape[1] - ids.shape[1]
        rows.append((new / t_plain, new / t_spec, t_plain / t_spec, spec.acceptance))
        print(f"  [{new} tokens | plain {new / t_plain:.1f} tok/s | speculative {new / t_spec:.1f} tok/s | "
              f"speed-up {t_plain / t_spec:.2f}x | mean acceptance length {spec.acceptance.mean_acceptance_length:.2f}"
              f" | identical to plain greedy: {'yes' if same else 'NO'}]", flush=True)
        if getattr(spec.acceptance, "fell_back_to_plain", False):
            print("  (automatic budget: after its warm-up rounds speculation was predicted not to pay on this machine, "
                  "so the rest of this answer ran as plain decoding)", flush=True)
        print(flush=True)

    merged = rows[0][3]
    for row in rows[1:]:
        merged = merged.merge(row[3])
    print("summary (medians over prompts):")
    print(f"  plain greedy     {statistics.median(r[0] for r in rows):6.1f} tokens/s")
    print(f"  tree speculation {statistics.median(r[1] for r in rows):6.1f} tokens/s")
    print(f"  speed-up         {statistics.median(r[2] for r in rows):6.2f}x")
    print(f"  mean acceptance length {merged.mean_acceptance_length:.2f} tokens per target forward (bonus token included)")
    accept = ", ".join(f"{a:.2f}" for a in merged.position_acceptance[:6])
    print(f"  position-wise acceptance (positions 1..): {accept}")
    print(f"  outputs identical to plain greedy: {identical}/{len(rows)}"
          + (" (int8 target and draft: the lossless CPU fast path)" if args.quantize == "int8" else ""))
    return 0 if identical == len(rows) else 1
