"""`poss demo`: the shipped draft on the embedded SmolLM2 target, every step of the CPU fast path side by side.

For each prompt: plain float32 greedy decoding, plain int8 decoding (lossless: the exact int8 path) and int8 with
tree speculation, streamed as it is accepted; then tokens/s and the speed-up of each step, whether speculation's
output is token-identical to plain decoding of the same model, and, when speculation loses on a prompt, why.
``--quantize none`` compares plain and speculative float32 only.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from .errors import positive_int

DEFAULT_DRAFT = "poss-smollm2-135m-instruct"
# four everyday requests with answers of a paragraph or more (speculation pays per round, so a one-line answer
# cannot show it): an explanation, code, and two tasks on a given text (a summary, notes made into a list), where
# copied candidates help most. Free stories are where this draft helps least:
# `--prompt "Write a short story about a robot who learns to paint."`
DEMO_PROMPTS = (
    "Explain what a hash table is to a beginner programmer.",
    "Write a Python function that checks whether a string is a palindrome, and explain how it works.",
    "Summarize the following paragraph in two sentences: The Great Barrier Reef is the world's largest coral reef "
    "system, composed of over 2,900 individual reefs and 900 islands stretching over 2,300 kilometres. It is located "
    "in the Coral Sea, off the coast of Queensland, Australia. The reef can be seen from outer space and is the "
    "world's biggest single structure made by living organisms. It supports a wide diversity of life and was "
    "selected as a World Heritage Site in 1981.",
    "Turn these notes into a bulleted list: buy milk and eggs, call the dentist to move the appointment to Friday, "
    "send the quarterly report to Anna, book train tickets to Berlin for the conference, water the plants",
)
MIN_POSITION_ROUNDS = 10  # a position-wise rate from fewer rounds is shown as a count only


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
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable); default: four built-in")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--repeats", type=positive_int, default=2,
                        help="timed runs of plain and speculative int8 decoding per prompt, interleaved; the fastest "
                             "of each is reported (default 2: on a machine shared with other work one run can be "
                             "slowed by a third)")
    parser.add_argument("--quantize", choices=["none", "int8"], default="int8",
                        help="int8 (default): plain fp32, plain int8 and int8 with speculation side by side (the exact "
                             "int8 path is lossless, docs/budget.md); none: plain and speculative float32 only")
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


def drafted_rounds(stats) -> int:
    """Rounds that verified at least one draft token (plain steps after a hand-over excluded)."""
    return stats.position_proposed[0] if stats.position_proposed else 0


def loss_reason(stats, speedup: float) -> str | None:
    """One line on why speculation lost on a prompt (None when it won)."""
    if speedup >= 1.0:
        return None
    if getattr(stats, "fell_back_to_plain", False):
        return ("the automatic budget measured that rounds did not pay on this machine and handed the rest of the "
                "answer to plain decoding (its measuring rounds cost the difference)")
    if getattr(stats, "plain_steps", 0):
        return (f"the automatic budget measured that rounds did not pay on this text and decoded {stats.plain_steps} "
                "of its tokens plainly (its measuring rounds cost the difference)")
    length = stats.mean_acceptance_length
    if drafted_rounds(stats) < MIN_POSITION_ROUNDS:
        return f"only {drafted_rounds(stats)} speculative rounds: too short an answer to pay for the draft's set-up"
    return (f"{length:.2f} tokens per target forward: too few draft tokens accepted on this text to pay for "
            "drafting and verifying the tree")


def position_line(stats, count: int = 6) -> str:
    """Position-wise acceptance with its counts: ``rate (accepted/reached)``; a count only below 10 rounds."""
    parts = []
    for accepted, reached in list(zip(stats.position_accepted, stats.position_proposed))[:count]:
        rate = f"{accepted / reached:.2f} " if reached >= MIN_POSITION_ROUNDS else ""
        parts.append(f"{rate}({accepted}/{reached})")
    return ", ".join(parts) if parts else "no draft tokens proposed"


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
    int8 = args.quantize == "int8"
    print(f"target: {args.target}   draft: {draft_path}   precision: "
          + ("float32 and int8 (the exact int8 path: lossless)" if int8 else "float32"), flush=True)
    fp32, tokenizer = load_target(args.target)
    target = quantized(load_target(args.target)[0], "int8") if int8 else fp32
    draft = quantized(load_draft(str(draft_path), target), args.quantize)
    gen = draft.generation_config
    print(f"tree: depth {gen.tree_depth}, top-k {gen.tree_top_k}, {gen.tree_total_tokens} nodes; "
          f"threads {torch.get_num_threads()}\n", flush=True)
    chat = uses_chat_template(args.target, tokenizer)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    ids, mask = encode_prompt(tokenizer, "Hello!", chat)  # warm-up, untimed
    for model in {id(fp32): fp32, id(target): target}.values():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=draft)

    rows, identical = [], 0
    for prompt in args.prompt or DEMO_PROMPTS:
        ids, mask = encode_prompt(tokenizer, prompt, chat)
        print(f"> {prompt}", flush=True)
        streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        spec_times, plain_times = [], []
        for repeat in range(args.repeats):  # interleaved, so drifting load hits both alike; the fastest of each
            spec, seconds = _time(lambda: target.generate(
                input_ids=ids, attention_mask=mask, assistant_model=draft, streamer=streamer if repeat == 0 else None,
                return_dict_in_generate=True, **kwargs))
            spec_times.append(seconds)
            plain, seconds = _time(lambda: target.generate(input_ids=ids, attention_mask=mask, **kwargs))
            plain_times.append(seconds)
        t_spec, t_plain = min(spec_times), min(plain_times)
        base, t_base = _time(lambda: fp32.generate(input_ids=ids, attention_mask=mask, **kwargs)) if int8 else (
            plain, t_plain)
        if args.no_stream:
            print(tokenizer.decode(spec.sequences[0, ids.shape[1]:], skip_special_tokens=True))
        same = torch.equal(spec.sequences, plain)
        identical += same
        new = spec.sequences.shape[1] - ids.shape[1]
        speedup = t_plain / t_spec
        # rates, not times: the fp32 answer can be shorter or longer than the int8 one
        rate_base = (base.shape[1] - ids.shape[1]) / t_base
        rows.append(dict(base=rate_base, plain=new / t_plain, spec=new / t_spec,
                         quant=new / t_plain / rate_base if int8 else None, speedup=speedup,
                         total=new / t_spec / rate_base, stats=spec.acceptance))
        name = "int8" if int8 else "fp32"
        steps = (f"plain fp32 {rows[-1]['base']:.1f} tok/s | plain int8 {new / t_plain:.1f} tok/s "
                 f"({rows[-1]['quant']:.2f}x) | " if int8 else f"plain {name} {new / t_plain:.1f} tok/s | ")
        print(f"  [{new} tokens | {steps}{name} + speculation {new / t_spec:.1f} tok/s (speed-up {speedup:.2f}x"
              + (f", {rows[-1]['total']:.2f}x over fp32" if int8 else "") + ") | mean acceptance length "
              f"{spec.acceptance.mean_acceptance_length:.2f} | identical to plain greedy: {'yes' if same else 'NO'}]",
              flush=True)
        if int8 and not torch.equal(base[:, : plain.shape[1]], plain[:, : base.shape[1]]):
            print("  (int8 and fp32 answers differ in wording: each is exact for its own precision)", flush=True)
        reason = loss_reason(spec.acceptance, speedup)
        if reason:
            print(f"  speculation lost here: {reason}", flush=True)
        print(flush=True)
    return _summary(rows, identical, int8)


def _summary(rows: list[dict], identical: int, int8: bool) -> int:
    merged = rows[0]["stats"]
    for row in rows[1:]:
        merged = merged.merge(row["stats"])
    median = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    print("summary (medians over prompts):")
    if int8:
        print(f"  plain fp32               {median('base'):6.1f} tokens/s")
        print(f"  plain int8               {median('plain'):6.1f} tokens/s   {median('quant'):.2f}x over fp32")
        print(f"  int8 + tree speculation  {median('spec'):6.1f} tokens/s   {median('speedup'):.2f}x over plain int8, "
              f"{median('total'):.2f}x over fp32")
    else:
        print(f"  plain greedy     {median('plain'):6.1f} tokens/s")
        print(f"  tree speculation {median('spec'):6.1f} tokens/s")
        print(f"  speed-up         {median('speedup'):6.2f}x")
    print(f"  mean acceptance length {merged.mean_acceptance_length:.2f} tokens per target forward (bonus token "
          f"included), {drafted_rounds(merged)} speculative rounds")
    print(f"  position-wise acceptance, rate (accepted/rounds that reached it), positions 1..: {position_line(merged)}")
    print(f"  outputs identical to plain greedy: {identical}/{len(rows)}"
          + (" (int8 + speculation against plain int8: the lossless CPU fast path)" if int8 else ""))
    return 0 if identical == len(rows) else 1
