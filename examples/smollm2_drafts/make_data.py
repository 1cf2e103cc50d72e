"""Self-distilled training data for drafts of the embedded SmolLM2-135M-Instruct target (resumable).

1. The target writes user prompts itself (sampled from its chat template's user prefix, steered in turn toward
   the kinds of requests users send: writing, role-play, reasoning, math, coding, extraction, STEM, humanities,
   short and long answers; deduplicated, degenerate ones dropped, evaluation prompts excluded).
2. The target answers them (batched), so drafts learn the target's own outputs: greedily, or for a share of the
   chunks (``--sampled-share``) by sampling at ``--temperature`` / ``--top-p``, so that the drafts also see the
   contexts that sampling users produce (such records carry ``"sampling"``).
3. Optionally (``--followups N``) the target writes a follow-up user turn for N answered conversations (spread
   over the whole set) and answers it, keeping its first answer: two-turn data in ``followups.jsonl.gz``, which
   ``split_data.py`` puts in place of the one-turn conversation it continues.

Everything is appended to JSONL files and stored compressed in ``data/smollm2-135m-instruct/`` so the work can span
several sittings: run the script again and it continues where it stopped. ``--minutes`` bounds one sitting.

    python examples/smollm2_drafts/make_data.py --prompts 6000 --minutes 60

Sampled tokens are drawn among the 50 top candidates inside a logits processor (`SampleAmongCandidates`, the same
temperature -> top-k 50 -> top-p distribution as transformers' sampling): a sampled batch-96 decode step took 333 ms
against 436 ms with transformers' top-p, which sorts the whole 49k vocabulary.

On a CPU with bf16 units a large batch pays (one thread, up to 128 new tokens: bfloat16 83 answer tokens/s at batch
32, 113 at 96, 121 at 160; the int8 copy 85 at 32 and 87 at 96): ``--batch-size 96 --chunk 96``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from transformers_poss.bench.run import bundled_questions
from transformers_poss.embedded import load_target
from transformers_poss.training.cli import resolve_device
from transformers_poss.training.distill import (REQUEST_CATEGORIES, int8_copy, read_jsonl, regenerate,
                                                synthesize_followups, synthesize_prompts)
from transformers_poss.training.precision import bf16_pays

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "smollm2-135m-instruct"
PACK_MINUTES = 10  # how often the answers are compressed for committing (and always at the end)


def _unpack(name: str) -> Path:
    """Work on a plain JSONL copy of the stored ``NAME.jsonl.gz`` (created if missing)."""
    plain, packed = DATA / name, DATA / f"{name}.gz"
    if packed.exists() and (not plain.exists() or plain.stat().st_mtime < packed.stat().st_mtime):
        with gzip.open(packed, "rb") as src, open(plain, "wb") as dst:
            shutil.copyfileobj(src, dst)
    plain.touch()
    return plain


def _pack(plain: Path) -> None:
    with open(plain, "rb") as src, gzip.open(f"{plain}.gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)


def assistant_tokens(tokenizer, records: list[dict]) -> int:
    """Assistant tokens in ``records`` (conversation lines of the answers file)."""
    return sum(len(tokenizer(m["content"])["input_ids"]) for r in records for m in r["messages"]
               if m["role"] == "assistant")


def evaluation_prompts() -> list[str]:
    """MT-Bench's turns (shipped with the package): never training data."""
    prompts = []
    for path in [bundled_questions()]:
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    prompts.extend(json.loads(line).get("turns", []))
    return prompts


def sampled_chunk(index: int, share: float) -> bool:
    """Whether answer chunk ``index`` is sampled: spread evenly, ``share`` of the chunks (a resumed run continues
    the same pattern, since the index comes from the answers already written)."""
    return int((index + 1) * share) > int(index * share)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6000, help="distinct prompts to synthesise in total")
    parser.add_argument("--max-new-tokens", type=int, default=384, help="answer length cap")
    parser.add_argument("--batch-size", type=int, default=16, help="answers generated together")
    parser.add_argument("--prompt-batch-size", type=int, default=32, help="prompts sampled together")
    parser.add_argument("--device", default="auto", help="where the target runs (auto: cuda if present, else cpu)")
    parser.add_argument("--chunk", type=int, default=64, help="answers generated between checkpoints")
    parser.add_argument("--segment-tokens", type=int, default=128,
                        help="answers that stopped leave their batch every this many new tokens, the others go on "
                             "(0: the whole batch runs until its longest answer ends)")
    parser.add_argument("--prompt-segment-tokens", type=int, default=32,
                        help="prompts that stopped leave their batch every this many tokens (0: never; 32 wrote "
                             "about 20%% more prompts per minute than 0 at batch 96)")
    parser.add_argument("--minutes", type=float, default=60.0, help="stop after about this long")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--precision", choices=("auto", "bfloat16", "int8", "float32"), default="auto",
                        help="weights the target generates with (auto: bfloat16 where this device runs it at least "
                             "1.5x faster than float32, else an int8 dynamic-quantized copy on a CPU, float32 on a "
                             "GPU)")
    parser.add_argument("--no-categories", action="store_true",
                        help="sample new prompts from the bare template instead of by request category")
    parser.add_argument("--followups", type=int, default=0,
                        help="answered conversations that get a follow-up turn in total (after every prompt is answered)")
    parser.add_argument("--sampled-share", type=float, default=0.0,
                        help="share of answer chunks sampled instead of greedy (0: all greedy; 0.5: every other one)")
    parser.add_argument("--temperature", type=float, default=0.8, help="temperature of sampled answers")
    parser.add_argument("--top-p", type=float, default=0.95, help="top-p of sampled answers")
    args = parser.parse_args(argv)
    if not 0.0 <= args.sampled_share <= 1.0:
        parser.error(f"--sampled-share must be between 0 and 1, got {args.sampled_share}")
    for flag in ("segment_tokens", "prompt_segment_tokens"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be 0 or a positive number of tokens, got {getattr(args, flag)}")
    if args.sampled_share and not args.temperature > 0:
        parser.error(f"--temperature must be above 0 for sampled answers, got {args.temperature}")
    if args.threads:
        torch.set_num_threads(args.threads)
    deadline = time.time() + 60 * args.minutes
    DATA.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    target, tokenizer = load_target("smollm2-135m-instruct", device=device)
    precision = args.precision
    if precision == "auto":
        use_bf16, why = bf16_pays(device)
        precision = "bfloat16" if use_bf16 else ("int8" if device == "cpu" else "float32")
        print(f"[data] generating in {precision} ({why})", flush=True)
    if precision == "int8":
        target = int8_copy(target)
    elif precision == "bfloat16":
        target = target.to(torch.bfloat16)
    exclude = evaluation_prompts()

    prompts_file = _unpack("prompts.jsonl")
    have = len(read_jsonl(prompts_file))
    while have < args.prompts and time.time() < deadline:
        goal = min(args.prompts, have + max(256, args.prompt_batch_size))
        synthesize_prompts(target, tokenizer, goal, prompts_file, batch_size=args.prompt_batch_size, exclude=exclude,
                           seed=have, progress=False, categories=None if args.no_categories else REQUEST_CATEGORIES,
                           segment_tokens=args.prompt_segment_tokens or None)
        have = len(read_jsonl(prompts_file))
        _pack(prompts_file)
    prompts = [r["prompt"] for r in read_jsonl(prompts_file)]
    excluded = {p.strip().lower() for p in exclude}
    assert not any(p.strip().lower() in excluded for p in prompts), "an evaluation prompt leaked into the training prompts"

    answers_file = _unpack("conversations.jsonl")
    records = read_jsonl(answers_file)
    total, packed = assistant_tokens(tokenizer, records), time.time()
    while time.time() < deadline:
        done = len(records)
        if done >= len(prompts):
            break
        # ids are indices into the prompt list, so a growing prefix resumes exactly where the file stops
        sampled = sampled_chunk(done // args.chunk, args.sampled_share)
        stats = regenerate(target, tokenizer, prompts[: done + args.chunk], answers_file, batch_size=args.batch_size,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature if sampled else 0.0,
                           top_p=args.top_p, seed=done, progress=False, segment_tokens=args.segment_tokens or None)
        records = read_jsonl(answers_file)
        total += assistant_tokens(tokenizer, records[done:])
        if time.time() - packed > 60 * PACK_MINUTES:  # the plain file is the checkpoint; the .gz is what is committed
            _pack(answers_file)
            packed = time.time()
        print(f"[data] {len(records)} conversations, {total} assistant tokens, "
              f"{stats['tokens_per_s']:.1f} tok/s this chunk ({'sampled' if sampled else 'greedy'})", flush=True)
    _pack(answers_file)
    if args.followups and time.time() < deadline:
        followups(target, tokenizer, args, exclude, deadline)
    return 0


def followup_order(ids) -> list[int]:
    """Answered conversation ids in the order follow-ups are written: a fixed pseudo-random order, so that
    follow-ups spread over every request kind and period of the data, and a resumed run picks the same ones."""
    return sorted(ids, key=lambda i: ((i * 2654435761) % 2**32, i))


def followups(target, tokenizer, args, exclude, deadline) -> None:
    """A follow-up turn for ``--followups`` answered conversations (resumable): the target writes the next user
    turn after its own answer, then answers it; the first answer is kept as it is. Written to
    ``followups.jsonl(.gz)`` (ids index the usable questions of ``followup-prompts.jsonl``, which
    ``split_data.followup_lines`` maps back to their sources); ``--sampled-share`` of the chunks are sampled, like the first answers."""
    answered = {r["id"]: r for r in read_jsonl(_unpack("conversations.jsonl"))}
    questions_file = _unpack("followup-prompts.jsonl")
    asked = {r["source"] for r in read_jsonl(questions_file)}
    todo = [i for i in followup_order(answered) if i not in asked][: max(0, args.followups - len(asked))]
    for start in range(0, len(todo), args.chunk):
        if time.time() >= deadline:
            break
        chunk = [answered[i] for i in todo[start : start + args.chunk]]
        turns = synthesize_followups(target, tokenizer, [r["messages"] for r in chunk], batch_size=args.prompt_batch_size,
                                     seed=len(asked) + start, exclude=exclude, keep_answers=True)
        with open(questions_file, "a", encoding="utf-8") as handle:
            for record, messages in zip(chunk, turns):
                handle.write(json.dumps({"source": record["id"], "messages": messages}, ensure_ascii=False) + "\n")
        _pack(questions_file)
    usable = [r["messages"] for r in read_jsonl(questions_file) if r["messages"]]
    answers_file = _unpack("followups.jsonl")
    records = read_jsonl(answers_file)
    total = followup_tokens(tokenizer, records)
    while time.time() < deadline and len(records) < len(usable):
        done = len(records)
        sampled = sampled_chunk(done // args.chunk, args.sampled_share)
        stats = regenerate(target, tokenizer, usable[: done + args.chunk], answers_file, batch_size=args.batch_size,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature if sampled else 0.0,
                           top_p=args.top_p, seed=done, progress=False, segment_tokens=args.segment_tokens or None,
                           keep_answers=True)
        records = read_jsonl(answers_file)
        total += followup_tokens(tokenizer, records[done:])
        _pack(answers_file)
        print(f"[data] {len(records)} follow-up turns of {len(usable)} asked, {total} new assistant tokens, "
              f"{stats['tokens_per_s']:.1f} tok/s this chunk ({'sampled' if sampled else 'greedy'})", flush=True)


def followup_tokens(tokenizer, records: list[dict]) -> int:
    """Assistant tokens of the follow-up answers only (the last turn of each record; the first is counted in the
    conversations file)."""
    return sum(len(tokenizer(r["messages"][-1]["content"])["input_ids"]) for r in records
               if r["messages"] and r["messages"][-1]["role"] == "assistant")


if __name__ == "__main__":
    sys.exit(main())
