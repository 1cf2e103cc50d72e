"""Conversations -> token ids in the target's chat template, with a mask of the assistant tokens.

Accepted layouts (per example): OpenAI ``{"messages": [{"role", "content"}, ...]}`` and ShareGPT
``{"conversations": [{"from", "value"}, ...]}``; sources: a JSON / JSONL file (optionally ``.gz``), a
``datasets.Dataset`` / ``DatasetDict``, a dataset name for ``datasets.load_dataset``, or a list of examples.

The assistant mask comes from the chat template itself:

- when the template marks assistant text with ``{% generation %}``, transformers' ``return_assistant_tokens_mask``;
- otherwise by rendering prefixes: for assistant message i, the text rendered for messages[:i] with the generation
  prompt and the text rendered for messages[:i+1] delimit (in characters) what the model produces for that turn, its
  end-of-turn token included; characters are mapped to tokens with the fast tokenizer's offsets.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from os.path import commonprefix

import torch

__all__ = [
    "normalize_messages",
    "load_conversations",
    "assistant_char_spans",
    "tokenize_conversation",
    "pair_loss_mask",
    "ConversationDataset",
]

_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
}
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def normalize_messages(example) -> list[dict]:
    """One example (ShareGPT, OpenAI or a bare list of turns) -> ``[{"role", "content"}, ...]``."""
    turns = example
    if isinstance(example, dict):
        for key in ("messages", "conversations", "conversation"):
            if key in example:
                turns = example[key]
                break
        else:
            raise ValueError(f"An example needs `messages` or `conversations`; got keys {sorted(example)}.")
    if not isinstance(turns, (list, tuple)):
        raise ValueError(f"The turns of an example must be a list of messages, got a {type(turns).__name__}.")
    messages = []
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict):
            raise ValueError(f"Message {number} must be an object with role and content, got {turn!r:.60}.")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in _ROLES:
            raise ValueError(f"Unknown role {role!r} in message {number}; expected one of {sorted(_ROLES)}.")
        messages.append({"role": _ROLES[role], "content": _text_content(content, number)})
    return messages


def _text_content(content, number: int) -> str:
    """The text of a message; missing, null and non-text content is refused (it would be trained as "None")."""
    if isinstance(content, str):
        return content
    if content is None:
        raise ValueError(f"Message {number} has no content (missing or null): give it text or drop the message.")
    raise ValueError(f"Message {number} has content of type {type(content).__name__}; it must be a string.")


def _read_json_file(path: str) -> list:
    from ..textfiles import read_lines

    if ".jsonl" in os.path.basename(path):  # plain or gzip-compressed; bad bytes and cut-off data name the line
        return [_json_line(line, path, number) for number, line in read_lines(path) if line.strip()]
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error}).") from None
    except (EOFError, gzip.BadGzipFile, UnicodeDecodeError, OSError) as error:
        raise ValueError(f"{path}: cannot be read ({error}); the file is truncated or not "
                         f"{'gzip-compressed ' if path.endswith('.gz') else ''}UTF-8 JSON.") from None
    if isinstance(data, dict):
        data = data.get("data", data.get("examples", [data]))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of examples, got a {type(data).__name__}.")
    return data


def _json_line(line: str, path: str, number: int):
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno}); fix or remove "
                         "the line.") from None


def load_conversations(source, split: str = "train", limit: int | None = None) -> list[list[dict]]:
    """Load conversations as lists of ``{"role", "content"}`` messages.

    Args:
        source: a JSON/JSONL(.gz) path, a `datasets` Dataset/DatasetDict, a dataset name, or a list of examples.
        split: split to use for a DatasetDict or a dataset name.
        limit: keep at most this many conversations.
    """
    where = "example"
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        examples = _read_json_file(str(source))
        where = f"{source}: example"
    elif isinstance(source, (str, os.PathLike)):
        from ..checks import require_local_path

        require_local_path(source, "data file")
        import datasets

        examples = datasets.load_dataset(str(source), split=split)
    elif hasattr(source, "keys") and split in source and not isinstance(source, list):
        examples = source[split]
    else:
        examples = source
    out = []
    for number, example in enumerate(examples, 1):
        try:
            messages = normalize_messages(example)
        except ValueError as error:
            raise ValueError(f"{where} {number}: {error}") from None
        if any(m["role"] == "assistant" for m in messages):
            out.append(messages)
        if limit is not None and len(out) >= limit:
            break
    if not out and isinstance(source, (str, os.PathLike)) and limit != 0:
        raise ValueError(
            f"{source}: no usable conversation ({len(examples)} example(s), none with an assistant "
            "message): give conversations as {\"messages\": [{\"role\": \"user\", ...}, {\"role\": \"assistant\", "
            "...}]} or ShareGPT {\"conversations\": [{\"from\": \"human\", ...}, {\"from\": \"gpt\", ...}]}."
        )
    return out


# ---------------------------------------------------------------------------------------------------- masks
def _render(tokenizer, messages, add_generation_prompt=False, chat_template=None) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
    )


def assistant_char_spans(tokenizer, messages, chat_template=None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans `[start, end)` of each assistant turn.

    A span runs from the end of the generation prompt to the end of the turn (end-of-turn token included, trailing
    whitespace that the template adds after it excluded).
    """
    full = _render(tokenizer, messages, chat_template=chat_template)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True, chat_template=chat_template)
        upto = _render(tokenizer, messages[: i + 1], chat_template=chat_template)
        if not full.startswith(upto):
            raise ValueError(
                "This chat template renders earlier turns differently once later turns follow, so assistant spans "
                "cannot be found by rendering prefixes; use a template with {% generation %} markers."
            )
        start = len(commonprefix([prompt, upto]))
        end = len(upto.rstrip())
        if end > start:
            spans.append((start, end))
    return full, spans


def _mask_from_generation_tags(tokenizer, messages, chat_template) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=chat_template
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _mask_from_spans(tokenizer, text, spans) -> tuple[list[int], list[int]]:
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask
    # slow tokenizers: tokenize the pieces between span boundaries separately
    ids, mask, cursor = [], [], 0
    for start, end in spans + [(len(text), len(text))]:
        for piece, flag in ((text[cursor:start], 0), (text[start:end], 1)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += piece_ids
                mask += [flag] * len(piece_ids)
        cursor = end
    return ids, mask


def tokenize_conversation(tokenizer, messages, max_length: int | None = None, chat_template=None) -> dict:
    """Token ids of the conversation in the chat template and its assistant mask.

    Returns:
        ``{"input_ids": list[int], "assistant_mask": list[int]}`` of equal length (at most ``max_length``).
    """
    template = chat_template or tokenizer.chat_template
    if template is None:
        raise ValueError("The tokenizer has no chat template; pass `chat_template`.")
    if _GENERATION_TAG.search(template):
        ids, mask = _mask_from_generation_tags(tokenizer, messages, chat_template)
    else:
        text, spans = assistant_char_spans(tokenizer, messages, chat_template=chat_template)
        ids, mask = _mask_from_spans(tokenizer, text, spans)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "assistant_mask": mask}


def pair_loss_mask(assistant_mask: torch.Tensor) -> torch.Tensor:
    """Token mask `[..., L]` -> pair mask `[..., L]`: pair t is trained when x_{t+2} is an assistant token.

    Pair t = (f_t, x_{t+1}) predicts f_{t+1}, whose lm_head gives the token x_{t+2}; the last two pairs get 0.
    """
    out = torch.zeros_like(assistant_mask)
    out[..., :-2] = assistant_mask[..., 2:]
    return out


class ConversationDataset(torch.utils.data.Dataset):
    """Tokenized conversations: items ``{"input_ids": [L], "assistant_mask": [L]}`` (LongTensors).

    Conversations with no assistant token left after truncation are dropped.
    """

    def __init__(self, conversations, tokenizer, max_length: int = 2048, chat_template=None):
        self.examples = []
        for messages in conversations:
            item = tokenize_conversation(tokenizer, messages, max_length=max_length, chat_template=chat_template)
            if sum(item["assistant_mask"][2:]) > 0:
                self.examples.append({k: torch.tensor(v, dtype=torch.long) for k, v in item.items()})

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def lengths(self) -> list[int]:
        """Tokens of every example (what ``train_sampling_strategy="group_by_length"`` batches by)."""
        return [len(e["input_ids"]) for e in self.examples]

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]

    @property
    def num_tokens(self) -> int:
        return sum(len(e["input_ids"]) for e in self.examples)
