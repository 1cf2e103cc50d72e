"""Tree speculation on the real embedded targets: identical to plain greedy generation (slow, marked integration)."""

import json
import pathlib

import pytest
import torch

from transformers_poss import PosSDraftConfig, PosSDraftModel

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
MT_BENCH = ROOT / "src" / "transformers_poss" / "bench" / "data" / "mt_bench.jsonl"  # shipped with the package
TRAINED_DRAFT = ROOT / "drafts" / "poss-smollm2-135m-instruct"


def _load(name):
    try:
        from transformers_poss.embedded import load_target
    except ImportError as error:
        pytest.skip(f"transformers_poss.embedded is not importable: {error}")
    try:
        return load_target(name)
    except (ImportError, FileNotFoundError, OSError, ModuleNotFoundError) as error:
        pytest.skip(f"embedded target {name} is not installed here: {error}")


def _questions(count):
    lines = MT_BENCH.read_text().splitlines()[:count]
    return [json.loads(line)["turns"][0] for line in lines]


def _chat_ids(tokenizer, text):
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"]


def _draft(target, trained_folder=None):
    """The shipped trained draft when present (tree 4 / 4 / 10), else a random one with a small, cheap tree."""
    if trained_folder is not None and trained_folder.exists():
        draft, shape = PosSDraftModel.from_pretrained(trained_folder), (4, 4, 10)
    else:
        torch.manual_seed(0)
        config = PosSDraftConfig.for_target(target.config, num_specialists=2, positions_per_specialist=1)
        draft, shape = PosSDraftModel(config), (2, 2, 4)
    draft.eval().attach_target(target)
    gen = draft.generation_config
    gen.tree_depth, gen.tree_top_k, gen.tree_total_tokens = shape
    return draft


@pytest.fixture(scope="module")
def smollm2():
    return _load("smollm2-135m-instruct")


def test_smollm2_greedy_identical_on_mt_bench(smollm2):
    """20 MT-Bench prompts, 64 new tokens each: token-identical to plain greedy generate."""
    target, tokenizer = smollm2
    draft = _draft(target, TRAINED_DRAFT)
    rounds = []
    for text in _questions(20):
        ids = _chat_ids(tokenizer, text)
        expected = target.generate(ids, max_new_tokens=64, do_sample=False)
        out = target.generate(ids, assistant_model=draft, max_new_tokens=64, do_sample=False, return_dict_in_generate=True)
        assert out.sequences.tolist() == expected.tolist(), text
        rounds += out.acceptance.accepted_lengths
    if TRAINED_DRAFT.exists():
        assert max(rounds) > 1


def test_smollm2_sampling_runs_with_processors(smollm2):
    target, tokenizer = smollm2
    draft = _draft(target, TRAINED_DRAFT)
    ids = _chat_ids(tokenizer, _questions(1)[0])
    torch.manual_seed(0)
    out = target.generate(
        ids, assistant_model=draft, max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.9,
        repetition_penalty=1.1, return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.shape[1] <= ids.shape[1] + 24
    assert sum(out.acceptance.accepted_lengths) + 1 >= out.sequences.shape[1] - ids.shape[1]


def test_gemma3_greedy_identical_past_its_sliding_window():
    """Gemma 3 270M (sliding window 512): a prompt longer than the window, so the compaction trims window layers."""
    target, tokenizer = _load("gemma3-270m")
    window = target.config.get_text_config().sliding_window
    text = " ".join(_questions(40))
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > window
    draft = _draft(target)
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.tolist() == expected.tolist()


def test_smollm2_int8_greedy_identical_on_mt_bench():
    """The CPU fast path: int8 target (per-token scales, exact attention) and int8 draft, identical to the int8
    target's own plain greedy output."""
    from transformers_poss import quantize_int8

    target, tokenizer = _load("smollm2-135m-instruct")  # a fresh copy: quantized in place
    quantize_int8(target)
    draft = quantize_int8(_draft(target, TRAINED_DRAFT))
    for text in _questions(6):
        ids = _chat_ids(tokenizer, text)
        expected = target.generate(ids, max_new_tokens=48, do_sample=False)
        out = target.generate(ids, assistant_model=draft, max_new_tokens=48, do_sample=False)
        assert out.tolist() == expected.tolist(), text


def _auto_budget_models(quantize: str, depth: int):
    """A fresh SmolLM2 target (int8 in place when asked), its tokenizer and the shipped draft with an automatic budget
    of ``depth`` levels, top-k 4, at most 16 nodes."""
    from transformers_poss import quantize_int8

    target, tokenizer = _load("smollm2-135m-instruct")  # a fresh copy: quantized in place
    draft = _draft(target, TRAINED_DRAFT)
    if quantize == "int8":
        quantize_int8(target)
        draft = quantize_int8(draft)
    gen = draft.generation_config
    gen.tree_depth, gen.tree_top_k, gen.tree_total_tokens, gen.tree_max_total_tokens = depth, 4, "auto", 16
    return target, tokenizer, draft


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_smollm2_auto_budget_hands_over_to_plain_decoding(quantize, monkeypatch):
    """The shipped draft with the automatic budget, falling back after 2 rounds: the rest runs in transformers' own
    `_sample` (fp32 sdpa, and int8 with exact attention), token-identical to plain greedy generate."""
    from transformers.generation.utils import GenerationMixin

    from transformers_poss.generation.budget import TreeBudget

    target, tokenizer, draft = _auto_budget_models(quantize, depth=2)
    continued = []
    original = GenerationMixin._sample

    def spy(self, input_ids, *args, **kwargs):
        cache = kwargs.get("cache")
        if cache is not None and cache.get_seq_length() > 0:
            continued.append(input_ids.shape[1])
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_sample", spy)
    monkeypatch.setattr(TreeBudget, "FIRST_PAUSE", 0)  # hand over at once (no plain stretch first)
    monkeypatch.setattr(TreeBudget, "should_fall_back", lambda self: self.round_index >= 2)
    for text in _questions(3):
        ids = _chat_ids(tokenizer, text)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        expected = target.generate(ids, **kwargs)
        continued.clear()
        out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **kwargs)
        assert out.sequences.tolist() == expected.tolist(), text
        assert out.acceptance.fell_back_to_plain and len(continued) == 1 and out.acceptance.plain_steps > 0


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_smollm2_auto_budget_pauses_and_speculates_again(quantize, monkeypatch):
    """The budget pausing speculation after 2 rounds: 16 plain rounds in the tree loop, then drafted rounds again,
    token-identical to plain greedy generate (fp32 sdpa, and int8 with exact attention)."""
    from transformers_poss.generation import budget as budget_module
    from transformers_poss.generation.budget import CostProfile, TreeBudget

    target, tokenizer, draft = _auto_budget_models(quantize, depth=3)
    gen = draft.generation_config
    gen.tree_context_candidates = False  # every round drafts (the budget cannot choose to draft nothing)
    flat = CostProfile(key="flat", verify_seconds={1: 1.0, 64: 1.0}, draft_context_seconds=0.01, draft_step_seconds=0.01)
    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: flat)  # trees pay: nodes are kept
    monkeypatch.setattr(TreeBudget, "should_fall_back", lambda self: self.rounds == 2 and not self.pauses)
    for text in _questions(2):
        ids = _chat_ids(tokenizer, text)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
        expected = target.generate(ids, **kwargs)
        out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **kwargs)
        stats = out.acceptance
        assert out.sequences.tolist() == expected.tolist(), text
        assert not stats.fell_back_to_plain and stats.plain_steps == 16 and max(stats.tree_depths[19:]) > 0
