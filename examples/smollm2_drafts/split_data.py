"""Split the committed SmolLM2 conversations into a training file and a held-out file no shipped draft has seen.

The shipped EAGLE-2 draft was trained on the first 5,200 conversations of
`data/smollm2-135m-instruct/conversations.jsonl.gz` (the file only grows at its end), so the held-out
conversations are drawn (seeded) from the ones after them: every draft, old or new, is then measured on text
it never trained on. The training file holds every other conversation in a seeded random order, so that
``data.max_conversations`` (a prefix) is a random sample of the whole set:

    python examples/smollm2_drafts/split_data.py --out ~/.cache/transformers-poss/runs/split
    poss train --config examples/smollm2_drafts/recipe.yaml --train ~/.cache/.../split/train.jsonl.gz \
        --eval ~/.cache/.../split/heldout.jsonl.gz ...
"""

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data" / "smollm2-135m-instruct" / "conversations.jsonl.gz"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for train.jsonl.gz and heldout.jsonl.gz")
    parser.add_argument("--seen", type=int, default=5200, help="leading conversations some shipped draft saw")
    parser.add_argument("--heldout", type=int, default=200, help="conversations held out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with gzip.open(DATA, "rt", encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    if len(lines) - args.seen < args.heldout:
        parser.error(f"{DATA} has {len(lines)} conversations: too few after --seen {args.seen} "
                     f"to hold out {args.heldout}")
    rng = random.Random(args.seed)
    held = set(rng.sample(range(args.seen, len(lines)), args.heldout))
    train = [i for i in range(len(lines)) if i not in held]
    rng.shuffle(train)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    for name, indices in (("train", train), ("heldout", sorted(held))):
        path = out / f"{name}.jsonl.gz"
        if path.exists():
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                if [line for line in handle if line.strip()] == [lines[i] for i in indices]:
                    print(f"{path}: unchanged ({len(indices)} conversations)")
                    continue
            sys.exit(f"{path} exists with other conversations: choose another --out (it is left as it is).")
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.writelines(lines[i] for i in indices)
        print(f"{path}: {len(indices)} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
