"""`poss vocab`: give an existing draft a reduced drafting vocabulary (no retraining)."""

from __future__ import annotations

import json


def add_arguments(parser) -> None:
    parser.add_argument("draft", help="folder of the draft (save_pretrained layout)")
    parser.add_argument("--target", required=True, help="embedded name, Hub id or folder of the target (for its tokenizer)")
    parser.add_argument("--size", type=int, default=8192, help="number of tokens in the draft vocabulary")
    parser.add_argument("--corpus", nargs="+", required=True,
                        help="JSONL files (ShareGPT 'conversations', OpenAI 'messages' or 'text') or plain text files")
    parser.add_argument("--output", required=True, help="folder to write the draft with its token map")


def corpus_texts(paths):
    """Assistant texts of JSONL conversation files, 'text' fields, or raw lines of plain text files."""
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    yield line
                    continue
                if not isinstance(record, dict):
                    continue
                for turn in record.get("conversations", []) or []:
                    if turn.get("from") in ("gpt", "assistant", "chatgpt", "bing", "bard"):
                        yield turn.get("value", "")
                for turn in record.get("messages", []) or []:
                    if turn.get("role") == "assistant":
                        yield turn.get("content", "")
                if isinstance(record.get("text"), str):
                    yield record["text"]


def run(args) -> int:
    import torch

    from ..modeling_poss import PosSDraftModel
    from .loaders import load_target
    from ..vocab import build_token_map, count_text_tokens, set_token_map, special_token_ids

    _, tokenizer = load_target(args.target)
    counts = count_text_tokens(corpus_texts(args.corpus), tokenizer)
    if int(counts.sum()) == 0:
        raise SystemExit("the corpus holds no text: give JSONL conversations or text files")
    draft = PosSDraftModel.from_pretrained(args.draft)
    vocab = counts.shape[0]
    if vocab < draft.config.vocab_size:
        counts = torch.nn.functional.pad(counts, (0, draft.config.vocab_size - vocab))
    counts = counts[: draft.config.vocab_size]
    token_map = build_token_map(counts, args.size, always_include=special_token_ids(tokenizer))
    set_token_map(draft, token_map)
    draft.save_pretrained(args.output)
    covered = float(counts[token_map].sum()) / float(counts.sum())
    print(f"draft vocabulary: {args.size} of {draft.config.vocab_size} tokens, covering {covered:.1%} of corpus tokens")
    print(f"wrote {args.output}")
    return 0
