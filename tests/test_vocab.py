"""Reduced draft vocabulary: map building, round trip, restricted drafting."""

import pytest
import torch

from helpers import tiny_draft, tiny_llama
from transformers_poss import PosSDraftModel
from transformers_poss.vocab import build_token_map, count_tokens, remove_token_map, set_token_map


def test_build_map_takes_most_frequent_and_forced_tokens():
    counts = count_tokens([[5, 5, 5, 9, 9, 1], torch.tensor([9, 2])], vocab_size=12)
    assert counts[9] == 3 and counts[5] == 3 and counts[0] == 0
    assert build_token_map(counts, 2).tolist() == [5, 9]
    assert build_token_map(counts, 3, always_include=[11]).tolist() == [5, 9, 11]
    with pytest.raises(ValueError):
        build_token_map(counts, 0)
    with pytest.raises(ValueError):
        count_tokens([[12]], vocab_size=12)


def test_map_added_to_existing_draft_round_trips(tmp_path):
    target = tiny_llama()
    draft = tiny_draft(target)
    ids, feats = torch.randint(0, 128, (1, 6)), torch.randn(1, 5, 64)
    set_token_map(draft, torch.tensor([4, 8, 15, 16, 23, 42, 60, 99]))
    assert draft.config.draft_vocab_size == 8
    with torch.no_grad():
        tree = draft.draft_tree(ids, feats, depth=3, top_k=3, total_tokens=8)
        full_logits = target.get_output_embeddings()(torch.randn(2, 64))
    assert set(tree.tokens[1:].tolist()) <= {4, 8, 15, 16, 23, 42, 60, 99}
    draft.save_pretrained(tmp_path)
    loaded = PosSDraftModel.from_pretrained(tmp_path).attach_target(target)
    assert loaded.draft_to_target.tolist() == [4, 8, 15, 16, 23, 42, 60, 99]
    with torch.no_grad():
        assert loaded.draft_tree(ids, feats, depth=3, top_k=3, total_tokens=8).paths() == tree.paths()
    # restricted logits are exactly the full logits' columns
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded.compute_logits(x), target.get_output_embeddings()(x)[:, loaded.draft_to_target])
    assert full_logits.shape[-1] == 128
    remove_token_map(loaded)
    with torch.no_grad():
        assert loaded.compute_logits(x).shape[-1] == 128


def test_map_with_duplicates_is_refused():
    draft = tiny_draft(tiny_llama())
    with pytest.raises(ValueError, match="duplicate"):
        set_token_map(draft, torch.tensor([1, 1, 2]))
    with pytest.raises(ValueError, match="lie in"):
        set_token_map(draft, torch.tensor([1, 500]))


@pytest.mark.integration
def test_reduced_vocabulary_is_lossless_on_the_real_target():
    from test_generation_real import TRAINED_DRAFT, _chat_ids, _draft, _load, _questions

    from transformers_poss.vocab import special_token_ids

    target, tokenizer = _load("smollm2-135m-instruct")
    draft = _draft(target, TRAINED_DRAFT)
    questions = _questions(4)
    # map from the prompts' own tokens plus the most common ids: small, so many target tokens are outside it
    counts = count_tokens([_chat_ids(tokenizer, q)[0] for q in questions], vocab_size=draft.config.vocab_size)
    counts[:2048] += 1
    set_token_map(draft, build_token_map(counts, 2048, always_include=special_token_ids(tokenizer)))
    for question in questions:
        ids = _chat_ids(tokenizer, question)
        plain = target.generate(ids, max_new_tokens=32, do_sample=False)
        spec = target.generate(ids, assistant_model=draft, max_new_tokens=32, do_sample=False)
        assert torch.equal(plain, spec), question


def test_tiny_vocabulary_map_keeps_greedy_output():
    target = tiny_llama()
    draft = tiny_draft(target)
    set_token_map(draft, torch.tensor([0, 5, 9, 17, 33, 64, 90, 127]))  # most target tokens cannot be drafted
    for seed in range(3):
        ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(ids, max_new_tokens=20, do_sample=False)
        spec = target.generate(ids, assistant_model=draft, max_new_tokens=20, do_sample=False)
        assert torch.equal(plain, spec)
