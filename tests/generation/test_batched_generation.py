"""Batched tree speculation (B > 1): every row identical to its own plain generate, rows stop on their own."""

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from transformers_poss.generation import PosSGenerateOutput
from transformers_poss.generation import batched as batched_generation
from transformers_poss.generation.batched import batch_total_tokens
from transformers_poss.speculation import acceptance, target_cache
from transformers_poss.speculation.drafter import PosSProposer
from transformers_poss.speculation.masks import BatchLayout, relayout_index
from transformers_poss.speculation.tree import BatchedTree
from test_generation import (  # noqa: F401 - sampling_target is a fixture
    SMALL_VOCAB,
    VOCAB,
    exact_joint,
    make_draft,
    sampling_p_values,
    sampling_target,
)
from tree_testing import (
    OracleProposer,
    RandomProposer,
    TargetTopKProposer,
    broken_rejection,
    one_thread,  # noqa: F401 - autouse fixture
    tiny_gemma3_target,
    tiny_llama_target,
    train_draft_briefly,
)

PAD = 0


def row_prompts(lengths, seed=5, vocab=VOCAB):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, n), generator=gen) for n in lengths]


def left_pad(prompts):
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1] :] = p[0]
        mask[i, width - p.shape[1] :] = 1
    return ids, mask


def solo(target, prompt, **kwargs):
    """The row's own plain greedy continuation (no batch, no padding)."""
    return target.generate(prompt, do_sample=False, pad_token_id=PAD, **kwargs)[0, prompt.shape[1] :].tolist()


def assert_rows_identical(target, draft, prompts, **kwargs):
    """Batched speculation: each row = its solo plain generate, padded with pad_token_id after it stopped."""
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, pad_token_id=PAD,
                          return_dict_in_generate=True, **kwargs)  # fmt: skip
    assert isinstance(out, PosSGenerateOutput)
    expected = [solo(target, p, **kwargs) for p in prompts]
    width = ids.shape[1]
    assert out.sequences.shape[1] == width + max(len(e) for e in expected)
    for i, row in enumerate(expected):
        assert out.sequences[i, :width].tolist() == ids[i].tolist()
        got = out.sequences[i, width:].tolist()
        assert got[: len(row)] == row, f"row {i}"
        assert all(t == PAD for t in got[len(row) :])
    return out


class PerRowProposer:
    """The batched proposer interface over one single-row proposer per row (scripted / random trees)."""

    def __init__(self, proposers):
        self.proposers = proposers
        self.rows = list(range(len(proposers)))  # original row of each batch row
        self.pending = [None] * len(proposers)
        self.batch_sizes = []
        self.total_tokens = None

    def append(self, tokens, features, valid):
        for b, r in enumerate(self.rows):
            new = (tokens[b][valid[b]][None], features[b][valid[b]][None])
            if self.pending[r] is not None:  # not proposed since (the row was done): concatenate
                new = tuple(torch.cat([a, c], 1) for a, c in zip(self.pending[r], new))
            self.pending[r] = new

    def select_rows(self, rows):
        self.rows = [self.rows[i] for i in rows.tolist()]

    def relayout(self, index, positions):
        pass

    def propose_batch(self, valid, positions, depth=None):
        self.batch_sizes.append(len(self.rows))
        trees = []
        for r in self.rows:
            trees.append(self.proposers[r].propose(*self.pending[r]))
            self.pending[r] = None
        return BatchedTree.pack(trees)


def use_row_proposers(monkeypatch, factory):
    made = []

    def make(draft, depth, top_k, total_tokens):
        made.append(PerRowProposer(factory()))
        return made[-1]

    monkeypatch.setattr(batched_generation, "make_batched_proposer", make)
    return made


# ---------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_rows_identical_with_trained_draft(make):
    """A briefly trained draft (fit on row 0 only: it is right there, mostly wrong on the others)."""
    target = make()
    prompts = row_prompts([11, 4, 8])
    draft = make_draft(target, depth=4, top_k=4, total=16)
    train_draft_briefly(target, draft, prompts[:1], steps=120)
    out = assert_rows_identical(target, draft, prompts, max_new_tokens=32)
    assert max(out.acceptance.accepted_lengths) >= 3


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_rows_identical_oracle_row_and_random_row(monkeypatch, make):
    """Row 0 gets trees around its own continuation (long runs), row 1 random trees: per-row holes in the cache."""
    target = make()
    prompts = row_prompts([10, 5])
    made = use_row_proposers(monkeypatch, lambda: [OracleProposer(target, prompts[0], depth=5, corrupt=0.1),
                                                   RandomProposer(VOCAB, num_nodes=9, max_depth=3, seed=1)])
    out = assert_rows_identical(target, make_draft(target), prompts, max_new_tokens=30)
    assert max(out.acceptance.accepted_lengths) >= 4
    assert max(made[0].proposers[0].feature_errors) < 1e-4  # row 0's draft saw its own target features


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_rows_identical_with_random_draft_and_eager(make):
    target = make(attn="eager")
    prompts = row_prompts([3, 12, 7, 9], seed=8)
    assert_rows_identical(target, make_draft(target, depth=3, top_k=3, total=8), prompts, max_new_tokens=20)


def test_compaction_every_round_keeps_rows_identical(monkeypatch):
    """Re-laying the cache out whenever a hole is shared (not only when worthwhile) changes nothing."""
    target = tiny_gemma3_target()
    prompts = row_prompts([9, 4, 6])
    calls = []

    def eager_relayout(valid, min_holes=8, min_fraction=0.125):
        index = relayout_index(valid, min_holes=1, min_fraction=0.0)
        calls.append(index is not None)
        return index

    monkeypatch.setattr(batched_generation, "relayout_index", eager_relayout)
    use_row_proposers(monkeypatch, lambda: [OracleProposer(target, prompts[0], depth=4, corrupt=0.0),
                                            RandomProposer(VOCAB, num_nodes=6, max_depth=2, seed=2),
                                            OracleProposer(target, prompts[2], depth=3, corrupt=0.3, seed=1)])
    assert_rows_identical(target, make_draft(target), prompts, max_new_tokens=24)
    assert sum(calls) >= 2


def test_relayout_index_drops_only_shared_holes():
    valid = torch.tensor([[0, 1, 1, 0, 1, 0, 0, 1], [0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    index = relayout_index(valid, min_holes=1, min_fraction=0.0)
    assert index.shape == (2, 5)  # 4 holes in row 0, 3 in row 1: 3 shared, 5 of 8 columns kept
    kept = valid.gather(1, index)
    assert kept.sum(1).tolist() == valid.sum(1).tolist()
    assert kept[:, -1].all() and (kept[:, 1:] >= kept[:, :-1]).all()  # left-padded again
    assert relayout_index(valid) is None  # 3 shared holes: not worth a copy by default


def test_batched_proposer_drafts_each_rows_own_tree():
    """The batched draft gives every row the tree the single-row proposer drafts for it alone."""
    target = tiny_llama_target()
    draft = make_draft(target, depth=4, top_k=3, total=12)
    prompts = row_prompts([7, 4, 10])
    ids, mask = left_pad(prompts)
    layout = BatchLayout.from_attention_mask(mask)
    with torch.no_grad():
        features = target.model(ids, attention_mask=mask).last_hidden_state
    roots = torch.tensor([[5], [9], [17]])
    batched = PosSProposer(draft, depth=4, top_k=3, total_tokens=12)
    batched.append(torch.cat([ids[:, 1:], roots], 1), features, layout.valid)
    trees = batched.propose_batch(layout.valid, layout.positions)
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            row_features = target.model(prompt).last_hidden_state
        single = PosSProposer(draft, depth=4, top_k=3, total_tokens=12)
        expected = single.propose(torch.cat([prompt[:, 1:], roots[b : b + 1]], 1), row_features)
        row, _ = trees.row(b)
        assert row.tokens[0] == roots[b, 0]
        assert row.paths() == expected.paths()


def test_batched_proposer_relayout_and_row_drop_keep_the_trees():
    """Dropping shared holes and finished rows from the draft's caches changes no row's tree."""
    target = tiny_llama_target()
    draft = make_draft(target, depth=4, top_k=3, total=10)
    ids, mask = left_pad(row_prompts([9, 3, 6]))
    layout = BatchLayout.from_attention_mask(mask)
    with torch.no_grad():
        features = target.model(ids, attention_mask=mask).last_hidden_state
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (3, 4), generator=gen)
    block = (torch.randn(3, 4, 64, generator=gen), torch.tensor([1, 4, 2]))
    proposers = [PosSProposer(draft, depth=4, top_k=3, total_tokens=10) for _ in range(2)]
    for proposer in proposers:
        proposer.append(torch.cat([ids[:, 1:], tokens[:, :1]], 1), features, layout.valid)
        proposer.propose_batch(layout.valid, layout.positions)  # the specialists cache the prompt
    grown = layout.append(block[1], 4)
    valid_new = torch.arange(4)[None] >= 4 - block[1][:, None]
    for proposer in proposers:
        proposer.append(tokens, block[0], valid_new)
    expected = proposers[0].propose_batch(grown.valid, grown.positions)
    index = relayout_index(grown.valid, min_holes=1, min_fraction=0.0)
    assert index is not None and index.shape[1] < grown.valid.shape[1]
    proposers[1].relayout(index, grown.positions)
    compact = grown.gather(index)
    trees = proposers[1].propose_batch(compact.valid, compact.positions)
    for b in range(3):
        assert trees.row(b)[0].paths() == expected.row(b)[0].paths()
    rows = torch.tensor([0, 2])
    proposers[1].select_rows(rows)
    fewer = proposers[1].propose_batch(compact.valid[rows], compact.positions[rows])
    assert [fewer.row(i)[0].paths() for i in range(2)] == [expected.row(b)[0].paths() for b in (0, 2)]


def test_trained_draft_with_finished_rows_and_relayouts(monkeypatch):
    """The real batched proposer through row drops (EOS in one row) and re-layouts every time a hole is shared."""
    target = tiny_gemma3_target()
    prompts = row_prompts([7, 12, 4], seed=3)
    draft = make_draft(target, depth=4, top_k=4, total=12)
    train_draft_briefly(target, draft, prompts[1:2], steps=100)
    eos = solo(target, prompts[0], max_new_tokens=24, eos_token_id=200)[5]
    calls = []

    def eager_relayout(valid, min_holes=8, min_fraction=0.125):
        calls.append((valid.shape[0], relayout_index(valid, min_holes=1, min_fraction=0.0)))
        return calls[-1][1]

    monkeypatch.setattr(batched_generation, "relayout_index", eager_relayout)
    out = assert_rows_identical(target, draft, prompts, max_new_tokens=28, eos_token_id=eos)
    assert any(index is not None for _, index in calls)
    assert calls[0][0] == 3 and calls[-1][0] < 3  # row(s) finished early left the batch
    assert max(out.acceptance.accepted_lengths) >= 3


def test_tree_budget_shrinks_with_batch_size():
    assert [batch_total_tokens(60, 10, b) for b in (1, 2, 4, 8)] == [60, 30, 15, 10]
    assert [batch_total_tokens(10, 4, b) for b in (1, 2, 4, 8)] == [10, 5, 4, 4]
    assert batch_total_tokens(3, 10, 2) == 3


# ---------------------------------------------------------------- stopping per row


def test_eos_per_row_and_finished_rows_leave_the_batch(monkeypatch):
    target = tiny_llama_target()
    prompts = row_prompts([8, 6, 10], seed=11)
    continuations = [solo(target, p, max_new_tokens=24) for p in prompts]
    eos = continuations[0][3]  # row 0 stops early, inside an accepted run
    assert eos not in continuations[1][:12]
    made = use_row_proposers(monkeypatch, lambda: [OracleProposer(target, p, depth=6, corrupt=0.0) for p in prompts])
    out = assert_rows_identical(target, make_draft(target), prompts, max_new_tokens=24, eos_token_id=[eos, 200])
    sizes = made[0].batch_sizes
    assert sizes[0] == 3 and sizes[-1] < 3 and sizes == sorted(sizes, reverse=True)
    assert out.sequences[0, -1] == PAD


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
def test_max_new_tokens_rows_cut_exactly(monkeypatch, max_new_tokens):
    target = tiny_gemma3_target()
    prompts = row_prompts([9, 5])
    use_row_proposers(monkeypatch, lambda: [OracleProposer(target, p, depth=6, corrupt=0.0) for p in prompts])
    out = assert_rows_identical(target, make_draft(target), prompts, max_new_tokens=max_new_tokens)
    assert out.sequences.shape[1] == 9 + max_new_tokens


def test_processors_see_each_rows_padded_sequence():
    """Greedy with a repetition penalty: row by row acceptance equals stock batched generate."""
    target = tiny_llama_target()
    draft = make_draft(target, depth=3, top_k=3, total=8)
    train_draft_briefly(target, draft, row_prompts([6]), steps=60)
    ids, mask = left_pad(row_prompts([6, 9]))
    kwargs = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.4, pad_token_id=PAD, attention_mask=mask)
    expected = target.generate(ids, **kwargs)
    assert target.generate(ids, assistant_model=draft, **kwargs).tolist() == expected.tolist()


def test_clear_errors_for_batches():
    target = tiny_llama_target()
    draft = make_draft(target)
    ids, mask = left_pad(row_prompts([4, 6]))
    with pytest.raises(ValueError, match="left-padded"):
        target.generate(ids, attention_mask=mask.flip(1), assistant_model=draft, max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, pad_token_id=PAD,
                        output_scores=True, return_dict_in_generate=True)  # fmt: skip


# ---------------------------------------------------------------- sampling keeps the target distribution

RUNS = 500
ALPHA = 1e-3


def batched_sample_counts(target, prompts, runs, **kwargs):
    """Joint counts of the first three tokens of each row, sampling B = len(prompts) rows at once."""
    ids, mask = left_pad(prompts)
    counts = [torch.zeros(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB) for _ in prompts]
    lengths = []
    draft = make_draft(target, depth=2, top_k=3, total=8)
    for _ in range(runs):
        out = target.generate(ids, attention_mask=mask, assistant_model=draft,
                              do_sample=True, max_new_tokens=4, pad_token_id=PAD, return_dict_in_generate=True,
                              **kwargs)  # fmt: skip
        for b in range(len(prompts)):
            t1, t2, t3 = out.sequences[b, ids.shape[1] : ids.shape[1] + 3].tolist()
            counts[b][t1, t2, t3] += 1
        lengths += out.acceptance.accepted_lengths
    return counts, lengths


SAMPLING_PROMPTS = [torch.tensor([[1, 5, 2, 7]]), torch.tensor([[3, 6]])]


SAMPLING_CASES = {
    "plain": ({}, []),
    "temperature-top-p": ({"temperature": 0.7, "top_p": 0.9}, [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]),
    "penalty-top-k": (  # the penalty ignores row 1's left padding, as stock batched generate does
        {"temperature": 0.8, "top_k": 5, "repetition_penalty": 1.3},
        [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8), TopKLogitsWarper(5)],
    ),
}


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampling_keeps_each_rows_target_distribution(monkeypatch, sampling_target, case):
    target = sampling_target
    kwargs, processors = SAMPLING_CASES[case]
    use_row_proposers(monkeypatch, lambda: [TargetTopKProposer(target, p) for p in SAMPLING_PROMPTS])
    torch.manual_seed(0)
    counts, lengths = batched_sample_counts(target, SAMPLING_PROMPTS, RUNS, **kwargs)
    assert lengths.count(3) > 0
    for prompt, row_counts in zip(SAMPLING_PROMPTS, counts):
        joint = exact_joint(target, prompt, LogitsProcessorList(processors))
        assert min(sampling_p_values(row_counts, joint)) > ALPHA


def test_broken_acceptance_rule_fails_the_batched_test(monkeypatch, sampling_target):
    target = sampling_target
    use_row_proposers(monkeypatch, lambda: [TargetTopKProposer(target, p) for p in SAMPLING_PROMPTS])
    monkeypatch.setattr(acceptance, "rejection_sample_children", broken_rejection)
    torch.manual_seed(0)
    counts, _ = batched_sample_counts(target, SAMPLING_PROMPTS, RUNS)
    joint = exact_joint(target, SAMPLING_PROMPTS[0], LogitsProcessorList())
    assert max(sampling_p_values(counts[0], joint)) < ALPHA


def test_layout_refuses_right_padding():
    with pytest.raises(ValueError, match="left-padded"):
        BatchLayout.from_attention_mask(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    layout = BatchLayout.from_attention_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert layout.root_positions.tolist() == [2, 3]
    assert target_cache.full_layer_cache().layers == []


# ---------------------------------------------------------------- real target (slow, marked integration)


@pytest.mark.integration
def test_smollm2_batches_of_four_identical_on_mt_bench():
    """8 MT-Bench prompts in batches of 4 with the shipped draft: each row = its own plain greedy generate."""
    from test_generation_real import TRAINED_DRAFT, _chat_ids, _draft, _load, _questions

    target, tokenizer = _load("smollm2-135m-instruct")
    draft = _draft(target, TRAINED_DRAFT)
    prompts = [_chat_ids(tokenizer, text) for text in _questions(8)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rounds = []
    for start in (0, 4):
        batch = prompts[start : start + 4]
        ids, mask = left_pad(batch)
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=32, do_sample=False,
                              pad_token_id=pad, return_dict_in_generate=True)  # fmt: skip
        for i, prompt in enumerate(batch):
            expected = target.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=pad)
            row = expected[0, prompt.shape[1] :].tolist()
            got = out.sequences[i, ids.shape[1] :].tolist()
            assert got[: len(row)] == row, f"prompt {start + i}"
            assert all(t == pad for t in got[len(row) :])
        rounds += out.acceptance.accepted_lengths
    if TRAINED_DRAFT.exists():
        assert max(rounds) > 1
