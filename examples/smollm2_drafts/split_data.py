"""Split the committed SmolLM2 conversations into a training file and a held-out file no shipped draft has seen.

The shipped EAGLE-2 draft was trained on the first 5,200 conversations of
`data/smollm2-135m-instruct/conversations.jsonl.gz` (the file only grows at its end), so the held-out
conversations are drawn (seeded) from the ones after them and before ``--heldout-upto`` (21,200: the file's length
when the held-out set was first drawn), so the same conversations stay held out as the data grows: every draft, old
or new, is then measured on text it never trained on. The training file holds every other conversation in a seeded
random order, so that ``data.max_conversations`` (a prefix) is a random sample of the whole set. A conversation that
`make_data.py` continued with a follow-up turn (``followups.jsonl.gz``) is trained on in its two-turn form, which
contains the one-turn one; held-out conversations stay one-turn:

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

DATA = Path(__file__).resolve().parents[2] / "data" / "smollm2-135m-instruct"


def read_gz_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [line if line.endswith("\n") else line + "\n" for line in handle if line.strip()]


def followup_lines(data: Path) -> dict[int, str]:
    """Source conversation id -> the line of its two-turn continuation (empty without follow-ups)."""
    questions, answers = data / "followup-prompts.jsonl.gz", data / "followups.jsonl.gz"
    if not (questions.exists() and answers.exists()):
        return {}
    asked = [json.loads(line) for line in read_gz_lines(questions)]
    sources = [r["source"] for r in asked if r["messages"]]  # followups.jsonl ids index the usable questions
    out = {}
    for line in read_gz_lines(answers):
        record = json.loads(line)
        source = sources[record["id"]]
        out[source] = json.dumps({**record, "id": source, "followup": True}, ensure_ascii=False) + "\n"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for train.jsonl.gz and heldout.jsonl.gz")
    parser.add_argument("--seen", type=int, default=5200, help="leading conversations some shipped draft saw")
    parser.add_argument("--heldout", type=int, default=200, help="conversations held out")
    parser.add_argument("--heldout-upto", type=int, default=21200,
                        help="held-out conversations are drawn before this line (fixed, so that growing the data "
                             "keeps the same held-out set)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=str(DATA), help="folder of conversations.jsonl.gz (and the follow-ups)")
    args = parser.parse_args(argv)
    data = Path(args.data).expanduser()
    lines = read_gz_lines(data / "conversations.jsonl.gz")
    upto = min(len(lines), args.heldout_upto)
    if upto - args.seen < args.heldout:
        parser.error(f"{data / 'conversations.jsonl.gz'} has {len(lines)} conversations: too few between --seen "
                     f"{args.seen} and --heldout-upto {args.heldout_upto} to hold out {args.heldout}")
    ids = [json.loads(line)["id"] for line in lines]
    longer = followup_lines(data)
    rng = random.Random(args.seed)
    held = set(rng.sample(range(args.seen, upto), args.heldout))
    train = [i for i in range(len(lines)) if i not in held]
    rng.shuffle(train)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    splits = (("train", [longer.get(ids[i], lines[i]) for i in train]), ("heldout", [lines[i] for i in sorted(held)]))
    for name, chosen in splits:
        path = out / f"{name}.jsonl.gz"
        if path.exists():
            if read_gz_lines(path) == chosen:
                print(f"{path}: unchanged ({len(chosen)} conversations)")
                continue
            sys.exit(f"{path} exists with other conversations: choose another --out (it is left as it is).")
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.writelines(chosen)
        two_turn = sum(ids[i] in longer for i in train) if name == "train" else 0
        print(f"{path}: {len(chosen)} conversations" + (f" ({two_turn} with a follow-up turn)" if two_turn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
