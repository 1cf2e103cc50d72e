"""Reduced draft vocabulary: draft over the most frequent target tokens only.

Drafting multiplies every predicted feature by the lm_head; restricting it to a frequency-ranked subset of the
vocabulary (the token map ``draft_to_target``, saved with the draft) makes each draft step cheaper. Verification
always uses the target's full vocabulary, so the output is unchanged; only tokens outside the map can never be
drafted (they still appear as the target's bonus tokens).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


def count_tokens(sequences: Iterable, vocab_size: int) -> torch.LongTensor:
    """Token frequencies `[vocab_size]` over an iterable of token-id sequences (lists or 1D tensors)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise ValueError(f"token ids must lie in [0, {vocab_size}); found {int(ids.min())}..{int(ids.max())}.")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def count_text_tokens(texts: Iterable[str], tokenizer) -> torch.LongTensor:
    """Token frequencies of a text corpus under ``tokenizer``."""
    counter: Counter = Counter()
    for text in texts:
        counter.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    if counter:
        ids = torch.tensor(list(counter.keys()))
        counts[ids] = torch.tensor(list(counter.values()))
    return counts


def build_token_map(counts: torch.Tensor, size: int, always_include: Iterable[int] = ()) -> torch.LongTensor:
    """The ``size`` most frequent token ids (sorted ascending), always including ``always_include``.

    Ties are broken by the lower token id, so the map is deterministic.
    """
    vocab_size = counts.shape[0]
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}.")
    forced = sorted({int(t) for t in always_include if t is not None and 0 <= int(t) < vocab_size})
    if len(forced) > size:
        raise ValueError(f"{len(forced)} tokens must always be included but the map holds only {size}.")
    score = counts.double().clone()
    score[forced] = float("inf")
    # stable descending sort over ids in ascending order = ties broken by lower id
    order = torch.sort(score, descending=True, stable=True).indices[:size]
    return torch.sort(order).values


def set_token_map(draft, token_ids: torch.Tensor) -> None:
    """Give ``draft`` a reduced drafting vocabulary (in place, no retraining); ``token_ids`` are target ids."""
    token_ids = torch.as_tensor(token_ids)
    if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
        raise ValueError(f"token map ids must be integers, got a {token_ids.dtype} tensor.")
    token_ids = token_ids.to(torch.long).reshape(-1)
    if token_ids.numel() == 0:
        raise ValueError("the token map is empty.")
    if int(token_ids.max()) >= draft.config.vocab_size or int(token_ids.min()) < 0:
        raise ValueError(f"token map ids must lie in [0, {draft.config.vocab_size}).")
    if torch.unique(token_ids).numel() != token_ids.numel():
        raise ValueError("the token map holds duplicate token ids.")
    _refuse_own_head(draft)
    device = draft.device
    draft._buffers.pop("draft_to_target", None)
    draft.__dict__.pop("draft_to_target", None)
    draft.register_buffer("draft_to_target", token_ids.to(device), persistent=True)
    draft.config.draft_vocab_size = int(token_ids.numel())
    object.__setattr__(draft, "_draft_head_weight", None)


def _refuse_own_head(draft) -> None:
    if getattr(draft.config, "own_lm_head", False):
        raise ValueError("This draft carries its own lm_head over its drafting vocabulary (an EAGLE-3 style head); "
                         "its token map belongs to that head and cannot be changed without retraining it.")


def remove_token_map(draft) -> None:
    """Draft over the full vocabulary again."""
    _refuse_own_head(draft)
    if "draft_to_target" in draft._buffers:
        del draft._buffers["draft_to_target"]
    draft.draft_to_target = None
    draft.config.draft_vocab_size = None
    object.__setattr__(draft, "_draft_head_weight", None)


def special_token_ids(tokenizer) -> list[int]:
    """Ids a map should always hold: eos / bos / pad and the tokenizer's other special tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
    return sorted(ids)
