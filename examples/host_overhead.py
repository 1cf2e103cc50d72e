"""Host overhead of one speculation round, where compute costs nothing: a tiny random target and draft.

The target and draft are a few kilobytes, so what is left of a round is the host's work: Python, operator dispatch,
tree building, masks, acceptance and cache compaction. This is the part that decides speed on a GPU, where a small
target's kernels take microseconds. Prints milliseconds per round for each phase the loop times, and a plain decode
step of the same target for comparison:

    python examples/host_overhead.py --rounds 200 --depth 6 --top-k 4 --total-tokens 16
    python examples/host_overhead.py --context-candidates 8   # trees with continuations copied from the context
    python examples/host_overhead.py --temperature 1 --tree-sampling draft_probabilities   # sampled rounds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import transformers_poss  # noqa: F401  (makes generate() tree-aware)
from transformers_poss import PosSDraftConfig, PosSDraftModel


def tiny_target(vocab_size: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="speculation rounds per measurement")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--top-k", "--top_k", type=int, default=4)
    parser.add_argument("--total-tokens", "--total_tokens", type=int, default=16)
    parser.add_argument("--context-candidates", type=int, default=0,
                        help="tokens per continuation copied from the context (tree_context_candidates; 0: off)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampling at it")
    parser.add_argument("--tree-sampling", "--tree_sampling", choices=("target_only", "draft_probabilities"),
                        default="target_only", help="acceptance rule of sampled rounds (tree_sampling)")
    parser.add_argument("--repeats", type=int, default=5, help="measurements; the median is printed")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = tiny_target()
    draft = PosSDraftModel(PosSDraftConfig.for_target(target.config, num_specialists=3, positions_per_specialist=2))
    draft.attach_target(target)
    gen = draft.generation_config
    gen.tree_depth, gen.tree_top_k, gen.tree_total_tokens = args.depth, args.top_k, args.total_tokens
    gen.tree_context_candidates = args.context_candidates
    gen.tree_sampling = args.tree_sampling
    ids = torch.randint(3, target.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=0) if args.temperature > 0 else {}
    plain_kwargs = {"max_new_tokens": args.rounds, "min_new_tokens": args.rounds, "do_sample": False, **sampling}

    per_phase: dict[str, list[float]] = {}
    plain_steps, rounds_seen = [], []
    target.generate(ids, assistant_model=draft, **{**plain_kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    for _ in range(args.repeats):
        start = time.perf_counter()
        target.generate(ids, **plain_kwargs)
        plain_steps.append((time.perf_counter() - start) / args.rounds)
        # an untrained draft is almost never right: every round accepts ~1 token, so rounds ~ new tokens
        out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **plain_kwargs)
        stats = out.acceptance
        rounds = max(stats.num_rounds, 1)
        rounds_seen.append(rounds)
        for phase, seconds in stats.timings.items():
            per_phase.setdefault(phase, []).append(seconds / rounds)
    print(f"tiny target and draft, depth {args.depth}, top-k {args.top_k}, {args.total_tokens} nodes, "
          f"{statistics.median(rounds_seen):.0f} rounds, context candidates {args.context_candidates}, "
          f"{'greedy' if not sampling else f'temperature {args.temperature}, {args.tree_sampling}'}, {args.threads} "
          f"thread(s), medians of {args.repeats}:")
    total = 0.0
    for phase, values in per_phase.items():
        value = statistics.median(values) * 1000
        total += value
        print(f"  {phase:16s} {value:7.3f} ms / round")
    print(f"  {'round':16s} {total:7.3f} ms")
    print(f"  {'plain step':16s} {statistics.median(plain_steps) * 1000:7.3f} ms (transformers' own decoding loop)")


if __name__ == "__main__":
    main()
