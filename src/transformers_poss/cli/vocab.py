"""`poss vocab`: give an existing draft a reduced drafting vocabulary (no retraining)."""

from __future__ import annotations

import json
import os

from .errors import positive_int


def add_arguments(parser) -> None:
    parser.add_argument("draft", help="folder of the draft (save_pretrained layout)")
    parser.add_argument("--target", required=True, help="embedded name, Hub id or folder of the target (for its tokenizer)")
    parser.add_argument("--size", type=positive_int, default=8192, help="number of tokens in the draft vocabulary")
    parser.add_argument("--corpus", nargs="+", required=True,
                        help="JSONL files (ShareGPT 'conversations', OpenAI 'messages' or 'text') or plain text files, "
                             "optionally gzip-compressed (.jsonl.gz, as `poss train` writes them)")
    parser.add_argument("--output", required=True, help="folder to write the draft with its token map (new or empty, "
                        "or the draft's own folder with --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty folder: replace the draft's files, keep the others")


def corpus_texts(paths):
    """Assistant texts of JSONL conversation files, 'text' fields, or raw lines of plain text files."""
    for path in paths:
        for number, record in _records(path):
            if isinstance(record, str):
                yield record
                continue
            if not isinstance(record, dict):
                continue
            for turn in _turns(record, "conversations", path, number):
                if turn.get("from") in ("gpt", "assistant", "chatgpt", "bing", "bard"):
                    yield _text(turn.get("value"), path, number)
            for turn in _turns(record, "messages", path, number):
                if turn.get("role") == "assistant":
                    yield _text(turn.get("content"), path, number)
            if isinstance(record.get("text"), str):
                yield record["text"]


def _records(path):
    """``(line or example number, record)``: JSON records of a .json / .jsonl file, or text lines (str) of others;
    each may be gzip-compressed (``.jsonl.gz``).

    A line of a .jsonl file, or a line of another file that starts like JSON, that does not parse is an error."""
    from ..textfiles import data_suffix, read_lines, read_text

    if data_suffix(path) == ".json":
        try:
            data = json.loads(read_text(path))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error}).") from None
        data = data.get("data", [data]) if isinstance(data, dict) else data
        yield from enumerate(data if isinstance(data, list) else [data], 1)
        return
    jsonl = data_suffix(path) == ".jsonl"
    for number, line in read_lines(path):
        line = line.strip()
        if not line:
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as error:
            if jsonl or line.startswith(("{", "[")):  # JSON that does not parse is an error, not text
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno}); "
                                 "fix or remove the line.") from None
            yield number, line


def _turns(record: dict, key: str, path, number: int) -> list:
    turns = record.get(key) or []
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ValueError(f"{path}:{number}: `{key}` must be a list of message objects.")
    return turns


def _text(content, path, number: int) -> str:
    if not isinstance(content, str):
        raise ValueError(f"{path}:{number}: an assistant message has no text content ({content!r:.40}).")
    return content


def check_arguments(args) -> None:
    """Everything `poss vocab` can check before loading the tokenizer and the draft."""
    from ..checks import positive_int, require_file, require_local_path
    from ..checkpoints.folders import check_output_folder
    from ..checkpoints.loading import check_draft_folder

    positive_int("--size", args.size)
    for path in args.corpus:
        require_file(path, "corpus file")
    require_local_path(args.draft, "draft folder")
    if os.path.isdir(args.draft):
        check_draft_folder(args.draft)
    check_output_folder(args.output, getattr(args, "overwrite", False), source=args.draft, allow_source=True)


def run(args) -> int:
    import torch

    from ..modeling_poss import PosSDraftModel
    from .loaders import load_target
    from ..vocab import build_token_map, count_text_tokens, set_token_map, special_token_ids

    check_arguments(args)
    texts = list(corpus_texts(args.corpus))  # read (and checked) before anything is loaded
    if not any(text.strip() for text in texts):
        raise SystemExit("the corpus holds no text: give JSONL conversations or text files")
    _, tokenizer = load_target(args.target)
    counts = count_text_tokens(texts, tokenizer)
    if int(counts.sum()) == 0:
        raise SystemExit("the corpus holds no text: give JSONL conversations or text files")
    draft = PosSDraftModel.from_pretrained(args.draft)
    vocab = counts.shape[0]
    if vocab < draft.config.vocab_size:
        counts = torch.nn.functional.pad(counts, (0, draft.config.vocab_size - vocab))
    counts = counts[: draft.config.vocab_size]
    token_map = build_token_map(counts, args.size, always_include=special_token_ids(tokenizer))
    set_token_map(draft, token_map)
    from ..checkpoints.folders import staged_folder

    with staged_folder(args.output) as staging:  # the draft's own folder keeps its files until the new ones are whole
        draft.save_pretrained(staging)
    covered = float(counts[token_map].sum()) / float(counts.sum())
    print(f"draft vocabulary: {args.size} of {draft.config.vocab_size} tokens, covering {covered:.1%} of corpus tokens")
    print(f"wrote {args.output}")
    return 0
