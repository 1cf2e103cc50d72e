"""``target.generate(assistant_model=<PosS draft>)``: identical to plain generate, with the stock path kept otherwise."""

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TextIteratorStreamer,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicCache
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

import transformers_poss
from transformers_poss import PosSDraftConfig, PosSDraftModel, generation
from transformers_poss.generation import hook
from transformers_poss.speculation import acceptance
from transformers_poss.generation import PosSCandidateGenerator, PosSGenerateOutput
from tree_testing import (
    OracleProposer,
    RandomProposer,
    TargetTopKProposer,
    broken_rejection,
    chi_square_p_value,
    one_thread,  # noqa: F401 - autouse fixture
    tiny_gemma3_target,
    tiny_llama_target,
    tiny_tokenizer,
    train_draft_briefly,
)

VOCAB = 96


def make_draft(target, depth=4, top_k=4, total=16, seed=1):
    torch.manual_seed(seed)
    config = PosSDraftConfig.for_target(target.config, num_specialists=2, positions_per_specialist=1)
    draft = PosSDraftModel(config).eval().attach_target(target)
    draft.generation_config.tree_depth = depth
    draft.generation_config.tree_top_k = top_k
    draft.generation_config.tree_total_tokens = total
    draft.generation_config.tree_context_candidates = False  # the draft's own trees; tests of copies turn them on
    return draft


def prompts(count, length=8, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1, length), generator=gen) for _ in range(count)]


def use_proposer(monkeypatch, factory):
    """Replace the draft's proposer by ``factory(candidate_generator)``; returns the list of proposers made."""
    made = []

    def make(self):
        made.append(factory(self))
        return made[-1]

    monkeypatch.setattr(PosSCandidateGenerator, "_make_proposer", make)
    return made


def truncated_last_run(out, prompt) -> bool:
    """Whether the last round accepted more tokens than generation kept (a stop fired inside the run)."""
    return 1 + sum(out.acceptance.accepted_lengths) > out.sequences.shape[1] - prompt.shape[1]


def assert_same(target, draft, prompt, **kwargs):
    expected = target.generate(prompt, **kwargs)
    out = target.generate(prompt, assistant_model=draft, return_dict_in_generate=True, **kwargs)
    assert isinstance(out, PosSGenerateOutput)
    assert out.sequences.tolist() == expected.tolist()
    return out


# ---------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
@pytest.mark.parametrize("shape", [(1, 1, 2), (5, 1, 6), (3, 2, 5), (4, 4, 16), (6, 10, 60)])
def test_greedy_identical_with_random_draft(make, shape):
    target = make()
    draft = make_draft(target, *shape)
    for prompt in prompts(2):
        assert_same(target, draft, prompt, max_new_tokens=20, do_sample=False)


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_identical_with_trained_draft(make):
    """A briefly trained draft accepts several tokens per round (non-contiguous rows gathered in the cache)."""
    target = make()
    draft = make_draft(target, depth=4, top_k=4, total=16)
    train_draft_briefly(target, draft, prompts(3), steps=120)
    longest = 0
    for prompt in prompts(4):
        out = assert_same(target, draft, prompt, max_new_tokens=32, do_sample=False)
        longest = max(longest, max(out.acceptance.accepted_lengths))
        assert out.acceptance.mean_acceptance_length >= 1.0
    assert longest >= 3


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_identical_with_oracle_trees(monkeypatch, make):
    """Trees around the target's continuation, level-ordered: long accepted runs, scattered rows, exact features."""
    target = make()
    draft = make_draft(target)
    for prompt in prompts(2, length=9):
        made = use_proposer(monkeypatch, lambda gen, p=prompt: OracleProposer(target, p, depth=5, corrupt=0.2))
        out = assert_same(target, draft, prompt, max_new_tokens=30, do_sample=False)
        assert max(out.acceptance.accepted_lengths) >= 4
        assert max(made[0].feature_errors) < 1e-4  # the draft got the target's post-norm features of each pair


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_greedy_identical_with_eager_attention(monkeypatch, make):
    target = make(attn="eager")
    prompt = prompts(1, length=9)[0]
    use_proposer(monkeypatch, lambda gen: OracleProposer(target, prompt, depth=5, corrupt=0.2))
    out = assert_same(target, make_draft(target), prompt, max_new_tokens=24, do_sample=False)
    assert max(out.acceptance.accepted_lengths) >= 3


def test_first_draft_call_gets_whole_prompt_then_accepted_tokens(monkeypatch):
    target = tiny_llama_target()
    made = use_proposer(monkeypatch, lambda gen: RandomProposer(VOCAB, num_nodes=6, max_depth=2))
    prompt = prompts(1)[0]
    out = target.generate(prompt, assistant_model=make_draft(target), max_new_tokens=12, return_dict_in_generate=True)
    calls = made[0].calls
    first_ids, first_features = calls[0]
    assert first_ids.tolist() == [prompt[0, 1:].tolist() + [int(out.sequences[0, 8])]]
    assert first_features.shape == (1, 8, 64)
    sizes = [ids.shape[1] for ids, _ in calls[1:]]
    assert sizes == out.acceptance.accepted_lengths[: len(sizes)]


@pytest.mark.parametrize("make", [tiny_llama_target, tiny_gemma3_target])
def test_processors_repetition_penalty_and_min_length(monkeypatch, make):
    target = make()
    draft = make_draft(target)
    settings = dict(repetition_penalty=1.5, no_repeat_ngram_size=3)
    for prompt in prompts(2):
        use_proposer(monkeypatch, lambda gen, p=prompt: OracleProposer(target, p, depth=4, **settings))
        out = assert_same(
            target, draft, prompt, max_new_tokens=24, do_sample=False, min_new_tokens=5, eos_token_id=[1, 7], **settings
        )
        assert max(out.acceptance.accepted_lengths) >= 3


# ---------------------------------------------------------------- stopping


def _continuation(target, prompt, n=24):
    return target.generate(prompt, max_new_tokens=n, do_sample=False)[0, prompt.shape[1] :].tolist()


def test_eos_inside_an_accepted_run(monkeypatch):
    target = tiny_llama_target()
    draft = make_draft(target)
    prompt = prompts(1)[0]
    tokens = _continuation(target, prompt)
    eos = [tokens[9], 200]  # several eos ids, one of them appears mid-continuation
    use_proposer(monkeypatch, lambda gen: OracleProposer(target, prompt, depth=6, corrupt=0.0))
    out = assert_same(target, draft, prompt, max_new_tokens=24, do_sample=False, eos_token_id=eos)
    stop = tokens.index(tokens[9])
    assert out.sequences.shape[1] == prompt.shape[1] + stop + 1
    assert truncated_last_run(out, prompt)


def test_max_length_and_max_new_tokens(monkeypatch):
    target = tiny_llama_target()
    draft = make_draft(target)
    prompt = prompts(1)[0]
    use_proposer(monkeypatch, lambda gen: OracleProposer(target, prompt, depth=6, corrupt=0.0))
    for kwargs in ({"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 13}, {"max_length": 17}):
        out = assert_same(target, draft, prompt, do_sample=False, **kwargs)
        assert out.sequences.shape[1] == prompt.shape[1] + kwargs.get("max_new_tokens", 17 - prompt.shape[1])
        assert not truncated_last_run(out, prompt)  # trees are cut to the remaining budget


def test_use_cache_false_and_user_cache(monkeypatch):
    """Tree verification always needs the target's cache: use_cache=False still works; a fresh user cache is used."""
    target = tiny_llama_target()
    draft = make_draft(target)
    prompt = prompts(1)[0]
    assert_same(target, draft, prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    cache = DynamicCache(config=target.config)
    expected = target.generate(prompt, max_new_tokens=10, do_sample=False)
    out = target.generate(prompt, assistant_model=draft, max_new_tokens=10, cache=cache, return_dict_in_generate=True)
    assert out.sequences.tolist() == expected.tolist()
    assert out.cache is cache and cache.get_seq_length() == prompt.shape[1] + 9
    with pytest.raises(ValueError, match="pre-filled cache"):
        target.generate(out.sequences, assistant_model=draft, max_new_tokens=4, cache=cache)


def test_stop_strings_and_custom_criteria(monkeypatch):
    target = tiny_llama_target()
    tokenizer = tiny_tokenizer()
    draft = make_draft(target)
    prompt = prompts(1)[0]
    tokens = _continuation(target, prompt)
    pieces = tokenizer.convert_ids_to_tokens(tokens)
    stop = pieces[4][-1] + pieces[5][0]  # spans a token boundary, inside the first accepted run
    use_proposer(monkeypatch, lambda gen: OracleProposer(target, prompt, depth=6, corrupt=0.0))
    out = assert_same(target, draft, prompt, max_new_tokens=24, stop_strings=[stop], tokenizer=tokenizer)
    assert out.sequences.shape[1] < prompt.shape[1] + 24 and truncated_last_run(out, prompt)

    class StopAfterToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == tokens[5]

    criteria = StoppingCriteriaList([StopAfterToken()])
    out = assert_same(target, draft, prompt, max_new_tokens=24, stopping_criteria=criteria)
    assert out.sequences[0, -1] == tokens[5] and out.sequences.shape[1] < prompt.shape[1] + 24
    assert truncated_last_run(out, prompt)


# ---------------------------------------------------------------- outputs, streamers, masks


def test_return_dict_scores_logits_and_acceptance(monkeypatch):
    target = tiny_llama_target()
    draft = make_draft(target)
    prompt = prompts(1)[0]
    kwargs = dict(max_new_tokens=12, repetition_penalty=1.3, output_scores=True, output_logits=True)
    expected = target.generate(prompt, return_dict_in_generate=True, **kwargs)
    use_proposer(monkeypatch, lambda gen: OracleProposer(target, prompt, depth=4, repetition_penalty=1.3))
    out = target.generate(prompt, assistant_model=draft, return_dict_in_generate=True, **kwargs)
    assert out.sequences.tolist() == expected.sequences.tolist()
    assert len(out.scores) == len(out.logits) == 12
    for ours, theirs in zip(out.scores + out.logits, expected.scores + expected.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    acceptance = out.acceptance
    assert sum(acceptance.accepted_lengths) >= 11  # the first token comes from the prefill
    assert len(acceptance.position_acceptance) >= 1
    assert set(acceptance.timings) == {"drafting", "verification", "acceptance", "cache_update"}
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1
    assert isinstance(target.generate(prompt, assistant_model=draft, max_new_tokens=3), torch.Tensor)


def test_streamers_receive_tokens_as_accepted(monkeypatch):
    target = tiny_llama_target()
    tokenizer = tiny_tokenizer()
    draft = make_draft(target)
    prompt = prompts(1)[0]

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    recorder = Recorder()
    use_proposer(monkeypatch, lambda gen: OracleProposer(target, prompt, depth=5, corrupt=0.0))
    out = target.generate(prompt, assistant_model=draft, max_new_tokens=16, streamer=recorder)
    assert recorder.ended and recorder.puts[0] == prompt[0].tolist()
    assert sum(recorder.puts[1:], []) == out[0, prompt.shape[1] :].tolist()
    assert max(len(p) for p in recorder.puts[1:]) > 1  # whole accepted runs at once

    text_streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    use_proposer(monkeypatch, lambda gen: OracleProposer(target, prompt, depth=5, corrupt=0.0))
    out = target.generate(prompt, assistant_model=draft, max_new_tokens=16, streamer=text_streamer)
    assert "".join(text_streamer) == tokenizer.decode(out[0, prompt.shape[1] :])


def test_left_padded_attention_mask(monkeypatch):
    target = tiny_llama_target()
    draft = make_draft(target)
    prompt = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompts(1)[0]], dim=-1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], dim=-1)
    use_proposer(monkeypatch, lambda gen: OracleProposer(target, prompt, depth=4, corrupt=0.0, padding=3))
    expected = target.generate(prompt, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = target.generate(prompt, attention_mask=mask, assistant_model=draft, max_new_tokens=16, do_sample=False)
    assert out.tolist() == expected.tolist()
    assert expected.tolist() != target.generate(prompt, max_new_tokens=16, do_sample=False).tolist()


# ---------------------------------------------------------------- sampling is lossless

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def sampling_target():
    target = tiny_llama_target(vocab_size=SMALL_VOCAB, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6)  # peaked distributions, like a trained LM
    target.generation_config.eos_token_id = None
    return target


def exact_joint(target, prompt, processors):
    """P(t1, t2, t3) `[V, V, V]` enumerated with the target and the processors applied row by row."""
    vocab = SMALL_VOCAB

    def dist(ids):
        with torch.no_grad():
            return torch.softmax(processors(ids, target(ids).logits[:, -1].float()), dim=-1)

    ids2 = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
    ids3 = torch.cat([ids2.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab)[:, None]], dim=1)
    return dist(prompt)[0][:, None, None] * dist(ids2)[:, :, None] * dist(ids3).view(vocab, vocab, vocab)


def sample_counts(target, draft, prompt, runs, **kwargs):
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB)
    lengths = []
    for _ in range(runs):
        out = target.generate(
            prompt, assistant_model=draft, do_sample=True, max_new_tokens=4, return_dict_in_generate=True, **kwargs
        )
        t1, t2, t3 = out.sequences[0, prompt.shape[1] : prompt.shape[1] + 3].tolist()
        counts[t1, t2, t3] += 1
        lengths += out.acceptance.accepted_lengths
    return counts, lengths


def sampling_p_values(counts, joint):
    """Pearson p-values of the (t1, t2) and (t2, t3) joints (t3 comes from depth-2 acceptances)."""
    return chi_square_p_value(counts.sum(2), joint.sum(2)), chi_square_p_value(counts.sum(0), joint.sum(0))


SAMPLING_CASES = {
    "plain": ({}, []),
    "temperature-top-p": ({"temperature": 0.7, "top_p": 0.9}, [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]),
    "penalty-top-k": (
        {"temperature": 0.8, "top_k": 5, "repetition_penalty": 1.3},
        [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8), TopKLogitsWarper(5)],
    ),
}
RUNS = 600
ALPHA = 1e-3  # false-alarm rate of each Pearson test (two per case); the seed is fixed, so runs are reproducible


@pytest.mark.parametrize(
    "case, proposer", [("plain", "target-top-k"), ("temperature-top-p", "target-top-k"), ("penalty-top-k", "draft")]
)
def test_sampling_keeps_the_target_distribution(monkeypatch, sampling_target, case, proposer):
    target = sampling_target
    prompt = torch.tensor([[1, 5, 2, 7]])
    draft = make_draft(target, depth=2, top_k=3, total=8)
    if proposer == "target-top-k":
        use_proposer(monkeypatch, lambda gen: TargetTopKProposer(target, prompt))
    kwargs, processors = SAMPLING_CASES[case]
    torch.manual_seed(0)
    counts, lengths = sample_counts(target, draft, prompt, RUNS, **kwargs)
    assert lengths.count(3) > 0  # depth-2 acceptances happened
    joint = exact_joint(target, prompt, LogitsProcessorList(processors))
    assert min(sampling_p_values(counts, joint)) > ALPHA


def test_broken_acceptance_rule_fails_the_same_test(monkeypatch, sampling_target):
    """Accepting child i with p(x_i), without renormalising after rejections, is caught by the test above."""

    target = sampling_target
    prompt = torch.tensor([[1, 5, 2, 7]])
    use_proposer(monkeypatch, lambda gen: TargetTopKProposer(target, prompt))
    monkeypatch.setattr(acceptance, "rejection_sample_children", broken_rejection)
    torch.manual_seed(0)
    counts, _ = sample_counts(target, make_draft(target, depth=2, top_k=3, total=8), prompt, RUNS)
    joint = exact_joint(target, prompt, LogitsProcessorList())
    assert max(sampling_p_values(counts, joint)) < ALPHA


# ---------------------------------------------------------------- clear errors


@pytest.fixture(scope="module")
def llama_and_draft():
    target = tiny_llama_target()
    return target, make_draft(target)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_beams": 2}, "num_beams=1"),
        ({"do_sample": True, "num_return_sequences": 2}, "num_return_sequences"),
        ({"cache_implementation": "static"}, "static"),
        ({"cache_implementation": "quantized"}, "quantized"),
        ({"cache_implementation": "offloaded"}, "offloaded"),
        ({"max_new_tokens": 300}, "max_position_embeddings"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
        ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
    ],
)
def test_clear_errors_for_unsupported_settings(llama_and_draft, kwargs, message):
    target, draft = llama_and_draft
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        target.generate(prompts(1)[0], assistant_model=draft, **kwargs)


def test_clear_errors_for_unsupported_inputs(llama_and_draft, monkeypatch):
    target, draft = llama_and_draft
    prompt = prompts(1)[0]
    class Sink(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="batch size 1"):  # batches work (test_batched_generation), not with streamers
        target.generate(prompt.repeat(2, 1), assistant_model=draft, max_new_tokens=4, streamer=Sink())

    class QuantizedLikeCache(DynamicCache):
        pass

    with pytest.raises(ValueError, match="quantized"):
        target.generate(prompt, assistant_model=draft, max_new_tokens=4, cache=QuantizedLikeCache(config=target.config))
    monkeypatch.setattr(target.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        target.generate(prompt, assistant_model=draft, max_new_tokens=4)


def test_clear_errors_for_drafts_that_do_not_fit(llama_and_draft, monkeypatch):
    target, _ = llama_and_draft
    prompt = prompts(1)[0]
    for other in (tiny_llama_target(vocab_size=64), tiny_gemma3_target()):
        with pytest.raises(ValueError, match="does not fit this target"):
            target.generate(prompt, assistant_model=make_draft(other), max_new_tokens=4)
    loose = PosSDraftModel(PosSDraftConfig.for_target(target.config, num_specialists=1, positions_per_specialist=1))

    def refuse(model):
        raise RuntimeError("no embeddings to borrow")

    monkeypatch.setattr(loose, "attach_target", refuse)
    with pytest.raises(ValueError, match="could not be attached"):
        target.generate(prompt, assistant_model=loose, max_new_tokens=4)


def test_generate_attaches_a_detached_draft(llama_and_draft):
    target, _ = llama_and_draft
    loose = PosSDraftModel(PosSDraftConfig.for_target(target.config, num_specialists=1, positions_per_specialist=1))
    prompt = prompts(1)[0]
    assert_same(target, loose.eval(), prompt, max_new_tokens=6, do_sample=False)
    assert loose.is_attached


# ---------------------------------------------------------------- stock behaviour for other assistants, the hook


def test_other_assistants_keep_the_stock_path(llama_and_draft, monkeypatch):
    target, _ = llama_and_draft

    def fail(*args, **kwargs):
        raise AssertionError("the tree loop must not run for this assistant")

    monkeypatch.setattr(hook, "tree_assisted_decoding", fail)
    prompt = prompts(1)[0]
    expected = target.generate(prompt, max_new_tokens=10, do_sample=False)
    small_lm = tiny_llama_target(seed=7, layers=1)
    assert target.generate(prompt, assistant_model=small_lm, max_new_tokens=10, do_sample=False).tolist() == (
        expected.tolist()
    )
    assert target.generate(prompt, prompt_lookup_num_tokens=3, max_new_tokens=10).tolist() == expected.tolist()


def test_hook_is_installed_on_import_and_reversible(llama_and_draft):
    target, draft = llama_and_draft
    prompt = prompts(1)[0]
    assert generation.is_tree_generation_enabled()
    original = hook._ORIGINALS["_assisted_decoding"]
    generation.enable_tree_generation()  # idempotent
    assert hook._ORIGINALS["_assisted_decoding"] is original
    generation.disable_tree_generation()
    try:
        assert not generation.is_tree_generation_enabled()
        assert GenerationMixin.__dict__["_assisted_decoding"] is original
        with pytest.raises(Exception):  # the stock loop cannot use a feature-level draft
            target.generate(prompt, assistant_model=draft, max_new_tokens=4)
    finally:
        transformers_poss.generation.enable_tree_generation()
    assert generation.is_tree_generation_enabled()
    assert_same(target, draft, prompt, max_new_tokens=6, do_sample=False)


def test_dispatched_target_with_offloaded_lm_head(tmp_path, monkeypatch):
    """device_map with layers and lm_head offloaded (weights on "meta", run by accelerate hooks) keeps working."""
    from transformers import AutoModelForCausalLM

    reference = tiny_llama_target()
    reference.save_pretrained(tmp_path / "target")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}  # fmt: skip
    target = AutoModelForCausalLM.from_pretrained(
        tmp_path / "target", device_map=device_map, offload_folder=tmp_path / "offload"
    )
    assert target.lm_head.weight.device.type == "meta"
    prompt = prompts(1)[0]
    draft = make_draft(target)
    use_proposer(monkeypatch, lambda gen: OracleProposer(reference, prompt, depth=4, corrupt=0.0))
    out = target.generate(prompt, assistant_model=draft, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.tolist() == reference.generate(prompt, max_new_tokens=12, do_sample=False).tolist()
    assert max(out.acceptance.accepted_lengths) > 1
    assert next(draft.parameters()).device.type == "cpu"
    monkeypatch.undo()  # the real proposer drafts through the offloaded lm_head too
    assert_same(target, draft, prompt, max_new_tokens=8, do_sample=False)


def test_draft_stored_in_bf16_runs_in_the_targets_dtype():
    from helpers import tiny_draft, tiny_llama

    target = tiny_llama()
    draft = tiny_draft(target).to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False), plain)
    assert draft.fc.weight.dtype == torch.bfloat16  # it ran in the target's dtype; the caller's draft is given back
