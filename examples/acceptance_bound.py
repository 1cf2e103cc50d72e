"""How far the acceptance rules are from the optimum, on the nodes a real sampled tree visits.

Runs the int8 SmolLM2 target with a shipped draft, ``tree_sampling="draft_probabilities"`` and a fixed tree, records
the target's ``p`` and the draft's ``q`` at every expanded node the verification walk reaches, then reports for
``k = 1, 2, 3, 4, 6, 8`` children per node the mean acceptance of

- the target-only rule (children: the draft's deterministic top-k, EAGLE's rule),
- the recursive rule (children drawn without replacement from ``q``, `rejection.recursive_rejection_sample`),
- the optimum over every exact rule for children drawn that way (`speculation.acceptance_bounds`).

    python examples/acceptance_bound.py --temperature 1 --prompts 6 --max-new-tokens 64
"""

import argparse
import json

import torch

from transformers_poss.bench.run import bundled_questions, load_questions, make_prompts
from transformers_poss.cli.loaders import load_draft, load_target, quantized
from transformers_poss.speculation import acceptance
from transformers_poss.speculation.acceptance_bounds import optimal_acceptance, recursive_acceptance, top_k_acceptance


def record_nodes(target, draft, prompts, temperature: float, max_new_tokens: int) -> list[tuple]:
    """``(p, q)`` (float64, `[V]` each) at every expanded node the walk of a sampled tree reached."""
    nodes = []
    rule = acceptance.recursive_rejection_sample

    def recording(target_probs, draft_probs, child_tokens, child_valid, generator=None):
        q = torch.nn.functional.pad(draft_probs, (0, target_probs.shape[-1] - draft_probs.shape[-1]))
        expanded = child_valid.any(dim=1)  # a leaf has no children, and no q of its own
        nodes.extend(zip(target_probs[expanded].double().unbind(0), q[expanded].double().unbind(0)))
        return rule(target_probs, draft_probs, child_tokens, child_valid, generator)

    acceptance.recursive_rejection_sample = recording  # the walk calls it once per depth with the reached nodes
    try:
        for seed, prompt in enumerate(prompts):
            torch.manual_seed(seed)
            target.generate(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, assistant_model=draft,
                            do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                            max_new_tokens=max_new_tokens)  # fmt: skip
    finally:
        acceptance.recursive_rejection_sample = rule
    return nodes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="drafts/poss-smollm2-135m-instruct")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=6, help="MT-Bench prompts (spread over the categories)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=200, help="nodes analysed (evenly spaced over those recorded)")
    parser.add_argument("--samples", type=int, default=300, help="draws per node for the estimates")
    parser.add_argument("--output", default=None, help="JSON of the table")
    args = parser.parse_args()

    target, tokenizer = load_target("smollm2-135m-instruct")
    target = quantized(target, "int8")
    draft = load_draft(args.draft, target)
    config = draft.generation_config
    config.tree_depth, config.tree_top_k, config.tree_total_tokens = 6, 4, 16
    config.tree_context_candidates, config.tree_sampling = False, "draft_probabilities"
    prompts = make_prompts(load_questions([bundled_questions()], args.prompts), tokenizer, chat=True)
    nodes = record_nodes(target, draft, prompts, args.temperature, args.max_new_tokens)
    picked = nodes[:: max(1, len(nodes) // args.nodes)]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for k in (1, 2, 3, 4, 6, 8):
        rules = {"target_only": [top_k_acceptance(p, q, k) for p, q in picked],
                 "recursive": [recursive_acceptance(p, q, k, args.samples, gen) for p, q in picked],
                 "optimum": [optimal_acceptance(p, q, k, args.samples, gen) for p, q in picked]}
        rows.append({"k": k} | {name: sum(values) / len(values) for name, values in rules.items()})
    outside = sum(float(p[q == 0].sum()) for p, q in picked) / len(picked)
    print(f"{len(picked)} of {len(nodes)} visited nodes, temperature {args.temperature}; target mass outside the "
          f"draft's vocabulary: {outside:.3f}")
    print("| children k | target-only (top-k) | recursive (drawn from q) | optimum for draws from q |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['k']} | {row['target_only']:.3f} | {row['recursive']:.3f} | {row['optimum']:.3f} |")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({"temperature": args.temperature, "nodes": len(picked), "outside_mass": outside,
                       "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
