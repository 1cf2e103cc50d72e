"""After the automatic budget falls back, the single-row loop hands the call over to transformers' own `_sample`:
outputs identical to plain generate, the stock loop really runs, sampling keeps the target distribution."""

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

from test_generation import exact_joint, make_draft, prompts, sample_counts, sampling_p_values, use_proposer
from transformers_poss.generation import budget as budget_module
from transformers_poss.generation.budget import CostProfile, TreeBudget
from tree_testing import (
    OracleProposer,
    TargetTopKProposer,
    one_thread,  # noqa: F401 - autouse fixture
    tiny_gemma3_target,
    tiny_llama_target,
)

FLAT = CostProfile(key="k", verify_seconds={1: 1.0, 64: 1.0}, draft_context_seconds=0.01, draft_step_seconds=0.01)


@pytest.fixture
def fall_back_after(monkeypatch):
    """``fall_back_after(n)``: the budget (flat measured costs) falls back once ``n`` rounds were verified; returns
    the list of input lengths `_sample` was called with to continue a cache (the hand-over)."""
    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: FLAT)
    monkeypatch.setattr(TreeBudget, "plain_probe_due", lambda self: False)  # every round a tree round
    monkeypatch.setattr(TreeBudget, "FIRST_PAUSE", 0)  # no plain stretch first: the fall-back hands over at once
    sample_calls = []
    original = GenerationMixin._sample

    def spy(self, input_ids, *args, **kwargs):
        cache = kwargs.get("cache")
        if cache is not None and cache.get_seq_length() > 0:  # a continuation (plain generate starts from nothing)
            assert cache.get_seq_length() == input_ids.shape[1] - 1
            sample_calls.append(input_ids.shape[1])
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_sample", spy)

    def arm(rounds):
        monkeypatch.setattr(TreeBudget, "should_fall_back", lambda self: self.rounds >= rounds)
        return sample_calls

    return arm


def auto_draft(target, depth=4):
    draft = make_draft(target, depth=depth, top_k=4, total=16)
    draft.generation_config.tree_total_tokens = "auto"
    draft.generation_config.tree_max_total_tokens = 16
    return draft


class Scored:
    """A scripted proposer whose trees carry cumulative scores (the automatic budget ranks nodes by them)."""

    def __init__(self, proposer, depth):
        self.proposer, self.depth = proposer, depth

    def propose(self, input_ids, target_hidden_states):
        tree = self.proposer.propose(input_ids, target_hidden_states)
        tree.scores = -0.1 * tree.depths.float()
        return tree


def count_forwards(target):
    """Record the number of new tokens of every target forward; returns (list, hook handle)."""
    lengths = []
    handle = target.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    return lengths, handle


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
@pytest.mark.parametrize("rounds", [0, 1, 3])
def test_greedy_identical_and_the_stock_loop_runs(fall_back_after, make, rounds):
    sample_calls = fall_back_after(rounds)
    target = make()
    draft = auto_draft(target)
    for prompt in prompts(2):
        expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
        sample_calls.clear()
        lengths, handle = count_forwards(target)
        out = target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False,
                              return_dict_in_generate=True)  # fmt: skip
        handle.remove()
        assert out.sequences.tolist() == expected.tolist()
        stats = out.acceptance
        tree_rounds = stats.num_rounds - stats.plain_steps
        assert stats.fell_back_to_plain and tree_rounds == rounds
        # the stock loop took over right after the tree rounds and produced every remaining token
        handed_over = prompt.shape[1] + 1 + sum(stats.accepted_lengths[:tree_rounds])
        assert sample_calls == [handed_over]
        assert stats.plain_steps == expected.shape[1] - handed_over > 0
        # one prefill, one forward per tree round, then one-token forwards only
        assert len(lengths) == 1 + tree_rounds + stats.plain_steps
        assert set(lengths[1 + tree_rounds :]) == {1}
        assert sum(stats.accepted_lengths) + 1 == expected.shape[1] - prompt.shape[1]
        assert stats.tree_depths[tree_rounds:] == [0] * stats.plain_steps
        assert out.cache.get_seq_length() == expected.shape[1] - 1


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_left_padding_mid_way(fall_back_after, monkeypatch, make):
    sample_calls = fall_back_after(2)
    target = make()
    prompt = torch.cat([torch.full((1, 3), 5), prompts(1)[0]], dim=-1)  # padding any token: the mask hides it
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], dim=-1)
    use_proposer(monkeypatch, lambda gen: Scored(OracleProposer(target, prompt, depth=4, corrupt=0.0, padding=3), 4))
    expected = target.generate(prompt, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = target.generate(prompt, attention_mask=mask, assistant_model=auto_draft(target), max_new_tokens=20,
                          do_sample=False, return_dict_in_generate=True)  # fmt: skip
    assert out.sequences.tolist() == expected.tolist()
    assert len(sample_calls) == 1 and max(out.acceptance.accepted_lengths) >= 2  # tree rounds accepted runs first
    unmasked = target.generate(prompt, attention_mask=torch.ones_like(mask), max_new_tokens=20, do_sample=False)
    assert expected.tolist() != unmasked.tolist()  # the mask matters


def test_eos_after_the_hand_over(fall_back_after):
    sample_calls = fall_back_after(2)
    target = tiny_llama_target()
    draft = auto_draft(target)
    prompt = prompts(1)[0]
    tokens = target.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1] :].tolist()
    eos = tokens[14]
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)  # fmt: skip
    assert out.tolist() == expected.tolist() and out[0, -1] == eos
    assert len(sample_calls) == 1 and sample_calls[0] < out.shape[1]


def test_max_new_tokens_reached_at_the_hand_over(fall_back_after):
    """The tree part ends exactly at max_new_tokens: no hand-over; one token more: the stock loop makes exactly it."""
    sample_calls = fall_back_after(2)
    target = tiny_llama_target()
    draft = auto_draft(target)
    prompt = prompts(1)[0]
    target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False)
    tree_tokens = sample_calls[0] - prompt.shape[1]
    for new_tokens, stock_calls in ((tree_tokens, 0), (tree_tokens + 1, 1)):
        sample_calls.clear()
        expected = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        out = target.generate(prompt, assistant_model=draft, max_new_tokens=new_tokens, do_sample=False,
                              return_dict_in_generate=True)  # fmt: skip
        assert out.sequences.tolist() == expected.tolist()
        assert len(sample_calls) == stock_calls and out.acceptance.plain_steps == stock_calls


def test_streamer_scores_and_logits(fall_back_after, monkeypatch):
    sample_calls = fall_back_after(2)
    target = tiny_llama_target()
    prompt = prompts(1)[0]

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ends += 1

    kwargs = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.3, output_scores=True, output_logits=True,
                  return_dict_in_generate=True)
    expected = target.generate(prompt, **kwargs)
    use_proposer(monkeypatch, lambda gen: Scored(OracleProposer(target, prompt, depth=4, repetition_penalty=1.3), 4))
    recorder = Recorder()
    out = target.generate(prompt, assistant_model=auto_draft(target), streamer=recorder, **kwargs)
    assert out.sequences.tolist() == expected.sequences.tolist() and len(sample_calls) == 1
    assert recorder.ends == 1 and recorder.puts[0] == prompt[0].tolist()
    assert sum(recorder.puts[1:], []) == out.sequences[0, prompt.shape[1] :].tolist()
    assert len(out.scores) == len(out.logits) == 16
    for ours, theirs in zip(out.scores + out.logits, expected.scores + expected.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert "plain_decoding" in out.acceptance.timings


# ---------------------------------------------------------------- sampling after the hand-over

SMALL_VOCAB = 8
RUNS = 600
ALPHA = 1e-3


@pytest.mark.parametrize("rounds", [0, 1])
def test_sampling_keeps_the_target_distribution(fall_back_after, monkeypatch, rounds):
    """(t1, t2, t3) with a hand-over after ``rounds`` tree rounds: the joint matches the exact target joint."""
    sample_calls = fall_back_after(rounds)
    target = tiny_llama_target(vocab_size=SMALL_VOCAB, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6)
    target.generation_config.eos_token_id = None
    prompt = torch.tensor([[1, 5, 2, 7]])
    draft = make_draft(target, depth=2, top_k=3, total=8)
    draft.generation_config.tree_total_tokens = "auto"
    use_proposer(monkeypatch, lambda gen: Scored(TargetTopKProposer(target, prompt), 2))
    torch.manual_seed(0)
    counts, _ = sample_counts(target, draft, prompt, RUNS, temperature=0.7, top_p=0.9)
    # after one round of up to 3 tokens, runs of 4 tokens hand over only when that round accepted little
    assert len(sample_calls) == RUNS if rounds == 0 else 50 < len(sample_calls) < RUNS
    joint = exact_joint(target, prompt, LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]))
    assert min(sampling_p_values(counts, joint)) > ALPHA
