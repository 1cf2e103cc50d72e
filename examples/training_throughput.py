"""Measure draft-training throughput (positions/s) on a real target's features, in float32 and bf16 autocast.

    python examples/training_throughput.py --conversations conv.jsonl --target smollm2-135m-instruct --batch-size 8

Positions are sequence positions (pairs) processed, padding included; real positions leave the padding out, and
assistant positions are those that carry loss. ``--precision auto`` adds the bf16 rows where bf16 measures faster than
float32 on this machine (what `poss train` then uses). ``--group-by-length`` batches the stored features longest
first, as `poss train`'s default length-grouped sampler does, instead of in file order. Like `poss train`, the script
lets malloc keep freed memory for reuse (fewer page faults per step); ``--no-keep-freed-memory`` leaves the allocator
alone, as training did before.
"""

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch

from transformers_poss import PosSDraftConfig, PosSDraftModel
from transformers_poss.embedded import load_target
from transformers_poss.training.data import ConversationDataset, load_conversations
from transformers_poss.training.features import (
    FeatureShardDataset,
    PosSDataCollator,
    TargetFeatures,
    draft_inputs,
    write_feature_shards,
)
from transformers_poss.training.memory import keep_freed_memory
from transformers_poss.training.objective import ObjectiveConfig, set_objective
from transformers_poss.training.precision import bf16_pays
from transformers_poss.vocab import build_token_map, count_tokens, set_token_map


def make_draft(target, dataset, specialists, per, vocab):
    config = PosSDraftConfig.for_target(target.config, num_specialists=specialists, positions_per_specialist=per)
    draft = PosSDraftModel(config).attach_target(target).train()
    if vocab:
        counts = count_tokens((e["input_ids"][e["assistant_mask"].bool()] for e in dataset.examples), config.vocab_size)
        set_token_map(draft, build_token_map(counts, vocab))
    set_objective(draft, ObjectiveConfig())
    return draft


def timed_steps(draft, batches, features=None, pad=0, bf16=False, real_counts=None):
    """Optimiser steps over ``batches`` (under bf16 autocast if ``bf16``); returns (positions/s, real positions/s,
    assistant positions/s). Real positions are ``real_counts`` (unpadded positions per batch) when given, else the
    positions themselves."""
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-5)
    positions = masked = 0
    start = time.perf_counter()
    for batch in batches:
        if features is not None:
            batch = draft_inputs(batch["tokens"], batch["loss_mask"], features(batch["tokens"], batch["attention_mask"]), pad)
            positions += int((batch["input_ids"] >= 0).sum())
        else:
            positions += int(batch["input_ids"].numel())
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = draft(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        masked += int(batch["loss_mask"].sum())
    seconds = time.perf_counter() - start
    real = positions if real_counts is None else sum(real_counts)
    return positions / seconds, real / seconds, masked / seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", choices=("full", "8192", "both"), default="both",
                        help="draft vocabularies to measure (the full one is slow: minutes per row)")
    parser.add_argument("--group-by-length", action="store_true",
                        help="batch the stored features longest first (poss train's default) instead of in file order")
    parser.add_argument("--precision", choices=("auto", "float32", "bf16", "both"), default="auto",
                        help="auto: float32, plus bf16 where it measures faster here")
    parser.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
                        help="leave malloc's thresholds alone (poss train raises them: fewer page faults per step)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"malloc keeps freed memory: {args.keep_freed_memory and keep_freed_memory()}")
    pays, why = bf16_pays("cpu")
    print(f"bf16: {why}")
    modes = {"auto": [False] + ([True] if pays else []), "float32": [False], "bf16": [True], "both": [False, True]}
    modes = modes[args.precision]
    target, tokenizer = load_target(args.target)
    dataset = ConversationDataset(load_conversations(args.conversations), tokenizer, args.max_length)
    print(f"{len(dataset)} sequences, {dataset.num_tokens} tokens")
    collate = PosSDataCollator(tokenizer.pad_token_id)
    def feature_rate(folder, autocast=False):
        start = time.perf_counter()
        write_feature_shards(target, dataset, folder, batch_size=args.batch_size, progress=False, autocast=autocast)
        return dataset.num_tokens / (time.perf_counter() - start)

    with tempfile.TemporaryDirectory() as folder:
        rate = feature_rate(folder)
        size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
        print(f"offline features: {rate:.0f} positions/s, "
              f"{size / dataset.num_tokens * 1000 / 1e6:.2f} MB per 1k tokens (bf16)")
        if True in modes:  # the target's pass under bf16 autocast (`features_autocast: true`), into its own folder
            with tempfile.TemporaryDirectory() as autocast_folder:
                rate = feature_rate(autocast_folder, autocast=True)
            print(f"offline features, bf16 autocast: {rate:.0f} positions/s")
        stored = FeatureShardDataset(folder)
        items = [stored[i] for i in range(len(stored))]
        if args.group_by_length:
            items.sort(key=lambda item: -len(item["input_ids"]))
        chunks = [items[b : b + args.batch_size] for b in range(0, len(items), args.batch_size)]
        offline = [collate(chunk) for chunk in chunks]
        real_counts = [sum(len(item["input_ids"]) for item in chunk) for chunk in chunks]
        padded, real = sum(int(batch["input_ids"].numel()) for batch in offline), sum(real_counts)
        order = "grouped by length" if args.group_by_length else "file order"
        print(f"offline batches: {padded} positions for {real} real ones ({padded / real:.2f}x, {order})")
        online = [collate(dataset.examples[b : b + args.batch_size]) for b in range(0, len(dataset), args.batch_size)]
        vocabs = {"full": [None], "8192": [8192], "both": [None, 8192]}[args.vocab]
        for specialists, per, vocab in [(s, n, v) for v in vocabs for s, n in ((1, 1), (3, 2))]:
            for bf16 in modes:
                draft = make_draft(target, dataset, specialists, per, vocab)
                timed_steps(draft, offline[:1], bf16=bf16)  # warm-up
                rate, real, masked = timed_steps(draft, offline, bf16=bf16, real_counts=real_counts)
                name = f"S={specialists} N={per} K={specialists * per} vocab={vocab or 'full'} " \
                       f"{'bf16' if bf16 else 'float32'}"
                print(f"{name}: offline {rate:.0f} positions/s ({real:.0f} real, {masked:.0f} assistant positions/s)",
                      flush=True)
                if vocab is None:
                    rate, _, masked = timed_steps(draft, online, TargetFeatures(target), tokenizer.pad_token_id, bf16)
                    print(f"{name}: online  {rate:.0f} positions/s ({masked:.0f} assistant positions/s)", flush=True)


if __name__ == "__main__":
    main()
