"""Held-out position-wise accuracy of several drafts on the same held-out conversations, all at the same depth.

Every draft is unrolled to ``--depth`` steps on the held-out conversations (a draft trained one step deep, like
EAGLE-2, then reuses its layer for every step, which is what it does when it drafts a tree). ``--features`` may be
given several times: each draft reads the folder whose stored layers are the ones it reads (the post-norm feature,
or its ``feature_layers``), e.g. the single-feature and the EAGLE-3-style folders of the same held-out split:

    python examples/smollm2_drafts/eval_drafts.py --features runs/smollm2-features/eval \
        --features runs/smollm2-features-e3/eval \
        eagle2=runs/smollm2-eagle2/final poss2=runs/smollm2-poss2/final eagle3=runs/smollm2-eagle3/final \
        --output runs/heldout.json
"""

import argparse
import json

import torch

from transformers_poss import PosSDraftModel
from transformers_poss.embedded import load_target
from transformers_poss.training.features import FeatureShardDataset, PosSDataCollator, batch_to, draft_feature_layers
from transformers_poss.training.objective import ObjectiveConfig, set_objective
from transformers_poss.training.trainer import evaluate_draft


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafts", nargs="+", metavar="LABEL=FOLDER")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--features", action="append", default=None,
                        help="held-out feature folder; repeat for drafts reading other layers "
                             "(default: runs/smollm2-features/eval)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="where target and drafts run (cpu, cuda, ...)")
    parser.add_argument("--output", default=None)
    parser.add_argument("--plot", default=None, help="PNG of top-1 accuracy by depth (needs matplotlib)")
    args = parser.parse_args()

    target, tokenizer = load_target(args.target, device=args.device)
    folders = args.features or ["runs/smollm2-features/eval"]
    datasets = [FeatureShardDataset(folder) for folder in folders]
    collate = PosSDataCollator(pad_token_id=tokenizer.pad_token_id or 0)
    batches_of = {}

    def batches_for(draft):
        layers = draft_feature_layers(draft)
        count = target.config.num_hidden_layers
        # the folder of exactly these layers first, else one of more layers (a view)
        index = next((i for i, d in enumerate(datasets) if (d.feature_layers or None) == layers), None)
        if index is None:
            index = next((i for i, d in enumerate(datasets) if d.can_serve(layers, count)), None)
        if index is None:
            raise SystemExit(f"no --features folder holds the layers this draft reads ({layers}); given: "
                             + ", ".join(f"{f} ({d.feature_layers})" for f, d in zip(folders, datasets)))
        key = (index, tuple(layers or ()))
        if key not in batches_of:
            dataset = FeatureShardDataset(folders[index], feature_layers=layers, num_hidden_layers=count)
            batches_of[key] = [collate([dataset[i] for i in range(s, min(len(dataset), s + args.batch_size))])
                               for s in range(0, len(dataset), args.batch_size)]
        return batches_of[key]

    results = {}
    for spec in args.drafts:
        label, folder = spec.split("=", 1)
        draft = PosSDraftModel.from_pretrained(folder).float().to(args.device).eval().attach_target(target)
        batches = batches_for(draft)
        set_objective(draft, ObjectiveConfig(num_unrolled_steps=args.depth, noise="none"))
        with torch.no_grad():
            metrics = evaluate_draft(draft, batches, lambda b: batch_to(b, args.device))
        results[label] = metrics
        print(f"{label:10s} acc " + " ".join(f"{metrics[f'acc_{d}']:.3f}" for d in range(1, args.depth + 1))
              + "  accept " + " ".join(f"{metrics[f'accept_{d}']:.3f}" for d in range(1, args.depth + 1))
              + f"  chain tau {metrics['chain_tau']:.2f}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({"features": folders, "depth": args.depth, "tokens": [d.num_tokens for d in datasets],
                       "drafts": results}, handle, indent=1)
    if args.plot:
        plot(results, args.depth, args.plot)


def plot(results: dict, depth: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    depths = list(range(1, depth + 1))
    for label, metrics in results.items():
        ax.plot(depths, [metrics[f"acc_{d}"] for d in depths], marker="o", label=label)
    ax.set_xlabel("draft depth (position)")
    ax.set_ylabel("held-out top-1 accuracy")
    ax.set_title("Draft accuracy by position (target's own continuation as context)")
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
