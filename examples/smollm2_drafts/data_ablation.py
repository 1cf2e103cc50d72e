"""How much of a draft's accuracy is data: the EAGLE-2 layout trained on growing prefixes of the same feature shards.

Each run starts from random weights and trains ``--epochs`` (one by default) over its share of the training shards
(the same steps per token for every share: a larger share trains proportionally longer), then reports held-out
accuracy by position at depth 6 on the same held-out features:

    python examples/smollm2_drafts/data_ablation.py --features ~/.cache/transformers-poss/runs/smollm2-features \
        --shares 0.25 0.5 1.0 --output runs/data-ablation.json

With several epochs each share trains towards its plateau, which says what more data gives a converged draft
(``--epochs 8 --batch-size 32``: the stage-1 recipe's epochs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from transformers_poss import PosSDraftConfig, PosSDraftModel
from transformers_poss.embedded import load_target
from transformers_poss.training.features import FeatureShardDataset, PosSDataCollator, batch_to
from transformers_poss.training.objective import ObjectiveConfig, set_objective
from transformers_poss.training.trainer import PosSTrainer, PosSTrainingArguments, evaluate_draft
from transformers_poss.vocab import set_token_map


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", required=True, help="folder with train/ and eval/ feature shards")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--vocab-from", default="drafts/eagle2-smollm2-135m-instruct",
                        help="draft whose reduced-vocabulary map every run uses (the same map for every share)")
    parser.add_argument("--runs", default=str(Path.home() / ".cache/transformers-poss/runs/data-ablation"))
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--epochs", type=float, default=1.0, help="epochs over each share")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    target, tokenizer = load_target("smollm2-135m-instruct")
    train = FeatureShardDataset(Path(args.features) / "train")
    held = FeatureShardDataset(Path(args.features) / "eval")
    collate = PosSDataCollator(pad_token_id=tokenizer.pad_token_id or 0)
    eval_batches = [collate([held[i] for i in range(s, min(len(held), s + 4))]) for s in range(0, len(held), 4)]
    token_map = PosSDraftModel.from_pretrained(args.vocab_from).draft_to_target
    results = {}
    for share in args.shares:
        count = max(1, int(round(share * len(train))))
        subset = torch.utils.data.Subset(train, range(count))
        torch.manual_seed(0)
        draft = PosSDraftModel(PosSDraftConfig.for_target(target.config, num_specialists=1, positions_per_specialist=1))
        if token_map is not None:
            set_token_map(draft, token_map)
        draft.attach_target(target)
        out = Path(args.runs) / (f"share-{share:g}" if args.epochs == 1 else f"share-{share:g}-epochs-{args.epochs:g}")
        training = PosSTrainingArguments(
            output_dir=str(out), per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
            learning_rate=args.learning_rate,
            warmup_steps=50, lr_scheduler_type="cosine", logging_steps=50, save_strategy="no", report_to="none",
            max_length=768, disable_tqdm=True, seed=0,
        )
        PosSTrainer(model=draft, args=training, target=target, train_dataset=subset).train()
        set_objective(draft, ObjectiveConfig(num_unrolled_steps=args.depth, noise="none"))
        metrics = evaluate_draft(draft, eval_batches, lambda b: batch_to(b, "cpu"))
        tokens = sum(len(train[i]["input_ids"]) for i in range(count))
        results[f"{share:g}"] = {"sequences": count, "tokens": tokens, "epochs": args.epochs, **metrics}
        print(f"share {share:g}, {args.epochs:g} epochs: {count} sequences, {tokens} tokens, acc "
              + " ".join(f"{metrics[f'acc_{d}']:.3f}" for d in range(1, args.depth + 1))
              + f", chain tau {metrics['chain_tau']:.2f}", flush=True)
        if args.output:
            Path(args.output).write_text(json.dumps({"features": args.features, "depth": args.depth,
                                                     "results": results}, indent=1))


if __name__ == "__main__":
    main()
