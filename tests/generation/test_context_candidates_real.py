"""Context candidates on the real SmolLM2 target: token-identical to plain greedy generation with prompts that copy
(extraction, summarising a given text) and prompts that do not, one prompt at a time and batched (slow, marked
integration)."""

import pytest
import torch

from test_generation_real import TRAINED_DRAFT, _chat_ids, _draft, _load, _questions

pytestmark = pytest.mark.integration

TEXT = ("The Amazon rainforest covers much of the Amazon basin of South America. This basin encompasses seven million "
        "square kilometers, of which five and a half million square kilometers are covered by the rainforest. The "
        "region includes territory belonging to nine nations, and Brazil holds sixty percent of the rainforest.")
COPYING = [
    f"Extract every number mentioned in this text, each with the sentence it appears in:\n\n{TEXT}",
    f"Summarise the following text in two sentences, reusing its wording:\n\n{TEXT}",
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def smollm2_with_draft():
    target, tokenizer = _load("smollm2-135m-instruct")
    draft = _draft(target, TRAINED_DRAFT)
    draft.generation_config.tree_context_candidates = True
    return target, tokenizer, draft


def test_smollm2_greedy_identical_with_context_candidates(smollm2_with_draft):
    target, tokenizer, draft = smollm2_with_draft
    copied = 0
    for text in COPYING + _questions(3):
        ids = _chat_ids(tokenizer, text)
        expected = target.generate(ids, max_new_tokens=48, do_sample=False)
        out = target.generate(ids, assistant_model=draft, max_new_tokens=48, do_sample=False,
                              return_dict_in_generate=True)  # fmt: skip
        assert out.sequences.tolist() == expected.tolist(), text
        copied += out.acceptance.source_tokens.get("context", 0)
    assert copied > 0  # the copying prompts did accept copied tokens


def test_smollm2_batched_greedy_identical_with_context_candidates(smollm2_with_draft):
    target, tokenizer, draft = smollm2_with_draft
    texts = [COPYING[0], _questions(1)[0], COPYING[2]]
    rows = [_chat_ids(tokenizer, text) for text in texts]
    width = max(r.shape[1] for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1] :], mask[i, width - r.shape[1] :] = r[0], 1
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=32, do_sample=False,
                          pad_token_id=pad, return_dict_in_generate=True)  # fmt: skip
    for i, r in enumerate(rows):
        expected = target.generate(r, max_new_tokens=32, do_sample=False, pad_token_id=pad)[0, r.shape[1] :].tolist()
        got = out.sequences[i, width:].tolist()
        assert got[: len(expected)] == expected, texts[i]
    assert out.acceptance.source_tokens.get("context", 0) > 0
