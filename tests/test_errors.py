"""Bad inputs get a short error that says what to do; nothing is silently wrong (library level)."""

import gzip
import json
import os
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, LlamaForCausalLM

from helpers import tiny_draft, tiny_llama
from test_official import _official_state, _write
from transformers_poss import PosSDraftConfig, PosSDraftModel
from transformers_poss.bench_methods import tree_shape

PROMPT = torch.tensor([[1, 5, 9, 3, 7, 2]])


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def _generate(target, draft, **kwargs):
    return target.generate(PROMPT, assistant_model=draft, max_new_tokens=6, do_sample=False, **kwargs)


# ---------------------------------------------------------------------------------------------------- tree values
@pytest.mark.parametrize("name", ["tree_depth", "tree_top_k", "tree_total_tokens"])
def test_zero_tree_value_is_an_error_not_the_default(target, name):
    draft = tiny_draft(target)
    setattr(draft.generation_config, name, 0)
    with pytest.raises(ValueError, match=f"`{name}` must be an integer >= [12], got 0"):
        _generate(target, draft)


@pytest.mark.parametrize("value", [2.7, "3", True])
def test_non_integer_depths_are_refused(target, value):
    draft = tiny_draft(target)
    draft.generation_config.tree_depth = value
    with pytest.raises(ValueError, match="`tree_depth` must be an integer >= 1"):
        _generate(target, draft)


@pytest.mark.parametrize("spelling", ["Auto", "auto ", " AUTO"])
def test_auto_is_accepted_in_any_case_and_spacing(target, spelling, tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    draft = tiny_draft(target)
    draft.generation_config.tree_total_tokens = spelling
    plain = target.generate(PROMPT, max_new_tokens=6, do_sample=False)
    assert torch.equal(_generate(target, draft), plain)


def test_auto_only_for_total_tokens(target):
    draft = tiny_draft(target)
    draft.generation_config.tree_top_k = "auto"
    with pytest.raises(ValueError, match="only accepted for tree_total_tokens"):
        _generate(target, draft)


def test_draft_tree_zero_depth_and_bench_shape_zero(target):
    draft = tiny_draft(target)
    with pytest.raises(ValueError, match="`tree_depth` must be an integer >= 1, got 0"):
        draft.draft_tree(PROMPT, torch.randn(1, PROMPT.shape[1] - 1, 64), depth=0)
    with pytest.raises(ValueError, match="`tree_total_tokens`"):
        with tree_shape(draft, total_tokens=0):
            pass
    assert draft.generation_config.tree_total_tokens == 60  # untouched


def test_zero_positions_per_specialist_in_from_official(tmp_path, target):
    folder = _write(tmp_path / "PosS2-tiny", _official_state(target, layers=2))
    with pytest.raises(ValueError, match="`positions_per_specialist` must be an integer >= 1, got 0"):
        PosSDraftModel.from_official(str(folder), target=target, positions_per_specialist=0)


# ---------------------------------------------------------------------------------------------------- loading drafts
@pytest.fixture
def saved_draft(tmp_path, target):
    folder = tmp_path / "draft"
    tiny_draft(target).save_pretrained(folder)
    return folder


def test_target_folder_given_as_draft_is_refused(tmp_path, target):
    target.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="is not a PosS draft .*model_type 'llama'.*pass it as the target"):
        PosSDraftModel.from_pretrained(tmp_path / "llama")
    # AutoModel picks the Llama class for a Llama folder (not a draft); a PosS-typed folder holding foreign weights is
    # refused through AutoModel too (next test)
    assert type(AutoModel.from_pretrained(tmp_path / "llama")).__name__ == "LlamaModel"


def test_foreign_weights_under_a_draft_config_are_refused(tmp_path, saved_draft, target):
    target.save_pretrained(tmp_path / "llama")
    shutil.copy(tmp_path / "llama" / "model.safetensors", saved_draft / "model.safetensors")
    for load in (PosSDraftModel.from_pretrained, AutoModel.from_pretrained):
        with pytest.raises(ValueError, match="does not hold the weights of a PosS draft: .*weights missing .*fc"):
            load(saved_draft)


def test_official_folder_given_to_from_pretrained_points_to_from_official(tmp_path, target):
    folder = _write(tmp_path / "PosS2-tiny", _official_state(target, layers=3))
    with pytest.raises(ValueError, match="from_official"):
        PosSDraftModel.from_pretrained(folder)
    assert PosSDraftModel.from_official(str(folder), target=target).config.num_specialists == 3  # all three kept


@pytest.mark.parametrize("damage", ["truncate", "random"])
def test_unreadable_weights_name_the_file(saved_draft, damage):
    path = saved_draft / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else os.urandom(4096))
    with pytest.raises(ValueError, match=f"{path}.*(truncated|not a readable).*save it again"):
        PosSDraftModel.from_pretrained(saved_draft)


def test_weights_cut_inside_the_data_are_refused(saved_draft):
    path = saved_draft / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="is (truncated|not a readable)"):
        PosSDraftModel.from_pretrained(saved_draft)


def _edit_config(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("count", [1, 3])
def test_hand_edited_num_specialists(saved_draft, count):
    _edit_config(saved_draft, lambda c: c.update(num_specialists=count))
    with pytest.raises(ValueError, match=f"num_specialists={count} but the weights hold 2 .*set num_specialists back"):
        PosSDraftModel.from_pretrained(saved_draft)


def test_config_without_hidden_size(saved_draft):
    _edit_config(saved_draft, lambda c: c.pop("hidden_size"))
    with pytest.raises(ValueError, match="config.json lacks hidden_size"):
        PosSDraftModel.from_pretrained(saved_draft)


def test_bad_rope_type_activation_and_theta(saved_draft):
    _edit_config(saved_draft, lambda c: c["rope_parameters"].update(rope_type="bogus"))
    with pytest.raises(ValueError, match="`rope_type` 'bogus' is unknown; use 'default' or one of"):
        PosSDraftModel.from_pretrained(saved_draft)
    with pytest.raises(ValueError, match="`hidden_act` 'swiglu' is not an activation"):
        PosSDraftConfig(hidden_size=64, num_attention_heads=4, hidden_act="swiglu")
    for theta in (-1.0, 0, float("nan")):
        with pytest.raises(ValueError, match="`rope_theta` must be a positive number"):
            PosSDraftConfig(hidden_size=64, num_attention_heads=4,
                            rope_parameters={"rope_type": "default", "rope_theta": theta})


@pytest.mark.parametrize("name", ["./no/such/draft", "/no/such/draft", "tests/no-such-draft", "a/b/c"])
def test_missing_local_path_is_not_tried_on_the_hub(name):
    with pytest.raises(FileNotFoundError, match="no such draft folder .*not looked up on the Hub"):
        PosSDraftModel.from_pretrained(name)


def test_token_map_out_of_range_is_refused_at_load(tmp_path, target):
    from transformers_poss.vocab import set_token_map

    draft = tiny_draft(target)
    set_token_map(draft, torch.arange(16))
    draft.save_pretrained(tmp_path / "mapped")
    path = tmp_path / "mapped" / "model.safetensors"
    state = load_file(path)
    state["draft_to_target"] = torch.arange(16) + 1000
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"token map .*ids span 1000\.\.1015, outside the vocabulary \[0, 128\)"):
        PosSDraftModel.from_pretrained(tmp_path / "mapped")


def test_saved_tree_shape_of_zero_is_refused_at_load(saved_draft):
    path = saved_draft / "generation_config.json"
    config = json.loads(path.read_text())
    config["tree_depth"] = 0
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="generation_config.json of .*`tree_depth` must be an integer >= 1"):
        PosSDraftModel.from_pretrained(saved_draft)


def test_target_on_meta_device(target):
    with torch.device("meta"):
        empty = LlamaForCausalLM(target.config)
    with pytest.raises(ValueError, match="meta device .*load it with real weights"):
        empty.generate(PROMPT, assistant_model=tiny_draft(target), max_new_tokens=4, do_sample=False)


def test_near_miss_of_an_embedded_name():
    from transformers_poss.embedded import load_target

    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        load_target("smollm2-135m")


# ---------------------------------------------------------------------------------------------------- near-ties
def test_bf16_greedy_warns_once_and_fp32_does_not(target):
    from transformers_poss import validation

    validation._warned_near_ties.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _generate(target, tiny_draft(target))
    assert not [w for w in caught if "near-ties" in str(w.message)]
    low = tiny_llama().to(torch.bfloat16)
    draft = tiny_draft(low).to(torch.bfloat16)
    assert not validation.is_bit_exact(low) and validation.is_bit_exact(target)
    with pytest.warns(UserWarning, match="bfloat16 target matches plain generate only up to floating-point near-ties"):
        _generate(low, draft)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _generate(low, draft)
    assert not [w for w in caught if "near-ties" in str(w.message)]  # once


def test_bench_reports_near_tie_agreement_instead_of_failing(capsys):
    from test_bench import broken, run_report

    from transformers_poss.bench import finish
    from transformers_poss.bench_methods import Prompt, baseline_method

    model = tiny_llama(vocab_size=128, hidden_size=32)
    model.generation_config.eos_token_id = None
    prompts = [Prompt(i, "f", "c", "p", torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(i)))
               for i in range(4)]
    methods = [baseline_method(model), broken(model, prompt_index=1, position=3)]
    report = run_report(model, prompts, methods, tokens=8)
    assert finish(report, None, greedy=True, exact=False) == 0  # bf16 / fp16: reported, not a failure
    agreement = report["methods"]["broken"]["near_tie_agreement"]
    assert agreement == {"identical_share": 0.75, "mean_tokens_before_first_difference": (8 * 3 + 3) / 4}
    assert report["methods"]["baseline"]["near_tie_agreement"]["identical_share"] == 1.0
    assert report["settings"]["bit_exact"] is False
    err = capsys.readouterr().err
    assert "Not bit-exact in this setting" in err and "broken: 75% identical" in err
    assert finish(report, None, greedy=True, exact=True) == 1  # float32 / int8 exact path: a mismatch fails


# ---------------------------------------------------------------------------------------------------- cost profile
@pytest.mark.parametrize("content", [
    json.dumps({"key": "k", "verify_seconds": {"1": 0.0, "2": 0.0, "4": 0.0}}),
    json.dumps({"key": "k", "verify_seconds": {}}),
    "\0" * 64,
    json.dumps({"key": "k", "verify_seconds": {"1": 0.01, "2": 0.02}, "draft_step_seconds": -1}),
])
def test_corrupt_cost_profile_is_measured_again_with_a_warning(tmp_path, monkeypatch, target, content):
    from transformers_poss import budget

    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    path = os.path.join(budget.cache_dir(), budget.profile_key(target, None, 10) + ".json")
    with open(path, "w") as handle:
        handle.write(content)
    with pytest.warns(UserWarning, match="cost profile .* is unusable .*measuring it again"):
        profile = budget.load_or_measure_profile(target, None, top_k=10, sizes=(1, 2, 4))
    assert budget.TreeBudget(profile, depth=2, max_nodes=4).plain_rate > 0
    assert budget.usable_profile(budget.CostProfile.from_json(open(path).read()))  # the cache was rewritten


# ---------------------------------------------------------------------------------------------------- checkpoints
def _checkpoint(folder, step, state=True, weights=True):
    folder.mkdir(parents=True)
    if weights:
        save_file({"w": torch.zeros(4)}, folder / "model.safetensors")
    if state:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_resume_skips_half_written_checkpoints(tmp_path):
    from transformers_poss.training.checkpoints import last_complete_checkpoint

    good = _checkpoint(tmp_path / "checkpoint-10", 10)
    _checkpoint(tmp_path / "checkpoint-20", 20, state=False)  # killed before the trainer state
    cut = _checkpoint(tmp_path / "checkpoint-30", 30)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 8])
    _checkpoint(tmp_path / "checkpoint-40", 40)
    (tmp_path / "checkpoint-40" / "trainer_state.json").write_text('{"global_st')  # cut-off state
    with pytest.warns(UserWarning, match="incomplete"):
        assert last_complete_checkpoint(tmp_path) == str(good)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-10", "incomplete-checkpoint-20", "incomplete-checkpoint-30", "incomplete-checkpoint-40"]
    assert last_complete_checkpoint(tmp_path / "missing") is None


def test_train_cli_resumes_from_the_last_complete_checkpoint(tmp_path):
    from transformers_poss.training.cli import _last_checkpoint

    _checkpoint(tmp_path / "checkpoint-5", 5)
    _checkpoint(tmp_path / "checkpoint-9", 9, weights=False)
    with pytest.warns(UserWarning, match="checkpoint-9 is incomplete"):
        assert _last_checkpoint(str(tmp_path)).endswith("checkpoint-5")


# ---------------------------------------------------------------------------------------------------- data files
GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


def test_bad_json_line_names_file_and_line(tmp_path):
    from transformers_poss.training.data import load_conversations

    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "\n" + GOOD + "\n{oops\n")
    with pytest.raises(ValueError, match=f"{path}:3: not valid JSON"):
        load_conversations(str(path))


def test_truncated_gzip_names_the_file(tmp_path):
    from transformers_poss.training.data import load_conversations

    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write((GOOD + "\n") * 300)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match=f"{path}: cannot be read .*truncated"):
        load_conversations(str(path))


@pytest.mark.parametrize("messages, problem", [
    ("hello", "must be a list of messages, got a str"),
    (["hello"], "Message 1 must be an object"),
    ([{"role": "user", "content": None}, {"role": "assistant", "content": "x"}], "Message 1 has no content"),
    ([{"role": "user"}, {"role": "assistant", "content": "x"}], "Message 1 has no content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}], "Message 2 has content of type int"),
])
def test_malformed_messages_name_file_and_example(tmp_path, messages, problem):
    from transformers_poss.training.data import load_conversations

    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=f"{path}: example 2: .*{problem}"):
        load_conversations(str(path))


def test_missing_data_file_is_not_a_dataset_name(tmp_path):
    from transformers_poss.training.data import load_conversations

    with pytest.raises(FileNotFoundError, match="no such data file"):
        load_conversations(str(tmp_path / "nope.jsonl"))


def test_distilled_file_with_a_cut_off_last_line_resumes(tmp_path):
    from transformers_poss.training.distill import read_jsonl

    path = tmp_path / "conversations.jsonl"
    path.write_text('{"id": 0}\n{"id": 1}\n{"id": 2, "mess')
    with pytest.warns(UserWarning, match="cut off"):
        assert read_jsonl(path) == [{"id": 0}, {"id": 1}]
    assert path.read_text() == '{"id": 0}\n{"id": 1}\n'  # appending continues cleanly
    path.write_text('{"id": 0}\n{bad\n{"id": 2}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
        read_jsonl(path)


def test_vocab_corpus_bad_json_line_is_an_error_not_text(tmp_path):
    from transformers_poss.cli_vocab import corpus_texts

    path = tmp_path / "corpus.jsonl"
    path.write_text(GOOD + '\n{"messages": [\n')
    with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
        list(corpus_texts([path]))
    text = tmp_path / "corpus.txt"
    text.write_text("plain words\n" + GOOD + "\n")
    assert list(corpus_texts([text])) == ["plain words", "yo"]
    null = tmp_path / "null.jsonl"
    null.write_text(json.dumps({"messages": [{"role": "assistant", "content": None}]}) + "\n")
    with pytest.raises(ValueError, match=f"{null}:1: an assistant message has no text"):
        list(corpus_texts([null]))


# ---------------------------------------------------------------------------------------------------- feature shards
def test_feature_shards_are_recomputed_for_another_target(tmp_path):
    from transformers_poss.training.features import FeatureShardDataset, TargetFeatures, write_feature_shards

    item = {"input_ids": torch.arange(12), "assistant_mask": torch.ones(12, dtype=torch.long)}
    first, second = tiny_llama(seed=0), tiny_llama(seed=7)
    write_feature_shards(first, [item], tmp_path, dtype=torch.float32, progress=False)
    write_feature_shards(second, [item], tmp_path, dtype=torch.float32, progress=False)
    stored = FeatureShardDataset(tmp_path)[0]["hidden_states"]
    expected = TargetFeatures(second)(item["input_ids"][None])[0]
    torch.testing.assert_close(stored, expected)
    index = json.loads((tmp_path / "features.json").read_text())
    assert index["target_fingerprint"]


def test_fingerprint_tracks_weights_not_only_the_name():
    from transformers_poss.training.features import target_fingerprint

    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    assert target_fingerprint(a) == target_fingerprint(b)
    with torch.no_grad():
        b.lm_head.weight.mul_(1.01)
    assert target_fingerprint(a) != target_fingerprint(b)


# ---------------------------------------------------------------------------------------------------- bench inputs
@pytest.mark.parametrize("content, problem", [
    ('{"turns": ["a"]}\n{oops\n', ":2: not valid JSON"),
    ('{"question_id": 1}\n', ":1: a question needs a non-empty 'turns' list"),
    ('{"turns": [3]}\n', r":1: turns\[0\] must be the prompt text"),
    ('["a"]\n', ":1: a question must be a JSON object"),
    ("\n\n", ": no questions"),
])
def test_bad_question_files(tmp_path, content, problem):
    from transformers_poss.bench import load_questions

    path = tmp_path / "q.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path}{problem}"):
        load_questions([path])


def test_question_file_missing_and_bad_count(tmp_path):
    from transformers_poss.bench import load_questions

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_questions([tmp_path / "nope.jsonl"])
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["a"]}\n{"turns": ["b"]}\n')
    with pytest.raises(ValueError, match="num_prompts must be an integer >= 1"):
        load_questions([path], num_prompts=-1)


# ---------------------------------------------------------------------------------------------------- train recipe
def _run_config(tmp_path, *flags):
    from transformers_poss.training.config import parse_train_args

    data = tmp_path / "train.jsonl"
    data.write_text(GOOD + "\n")
    return parse_train_args(["--target", "x", "--train", str(data), "--output_dir", str(tmp_path / "out"),
                             "--use_cpu", "true", *flags])


@pytest.mark.parametrize("flags, problem", [
    (["--num_specialists", "0"], "`--num_specialists` must be an integer >= 1, got 0"),
    (["--positions_per_specialist", "-2"], "`--positions_per_specialist` must be an integer >= 1, got -2"),
    (["--train", "missing.jsonl"], "--train file missing.jsonl does not exist"),
    (["--train", "./data/missing"], "no such --train file"),
    (["--eval_fraction", "1.0"], "must be below 1"),
    (["--init_from", "./no/such/draft"], "no such --init_from draft folder"),
    (["--generation_max_new_tokens", "0"], "`--generation_max_new_tokens` must be an integer >= 1"),
])
def test_recipe_checks(tmp_path, flags, problem):
    from transformers_poss.training.recipe_checks import check_recipe

    check_recipe(_run_config(tmp_path))  # the unchanged run passes
    with pytest.raises((ValueError, FileNotFoundError), match=problem):
        check_recipe(_run_config(tmp_path, *flags))


def test_prompts_file_needs_prompt_strings(tmp_path):
    from transformers_poss.training.recipe_checks import check_recipe

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=f'{prompts}: record 2 needs a non-empty "prompt" string'):
        check_recipe(_run_config(tmp_path, "--prompts", str(prompts)))


def test_init_from_vocabulary_conflict_is_found_before_the_data_stage(tmp_path, target):
    from transformers_poss.training.recipe_checks import check_recipe
    from transformers_poss.vocab import set_token_map

    source = tiny_draft(target, num_specialists=1)
    set_token_map(source, torch.arange(32))
    source.save_pretrained(tmp_path / "eagle")
    check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "eagle"), "--draft_vocab_size", "32"))
    with pytest.raises(ValueError, match="--draft_vocab_size 16 differs from the vocabulary of --init_from"):
        check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "eagle"), "--draft_vocab_size", "16"))
    target.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="is not a PosS draft"):
        check_recipe(_run_config(tmp_path, "--init_from", str(tmp_path / "llama")))


def test_draft_shape_is_checked_against_the_target(tmp_path, target):
    from transformers_poss.training.recipe_checks import check_draft_fits

    check_draft_fits(_run_config(tmp_path), target)
    with pytest.raises(ValueError, match="the draft does not fit the target x: `draft_vocab_size` \\(500\\) exceeds"):
        check_draft_fits(_run_config(tmp_path, "--draft_vocab_size", "500"), target)


# ---------------------------------------------------------------------------------------------------- found later
def test_specialist_index_must_be_an_integer_in_range(target):
    draft = tiny_draft(target)
    features = torch.randn(1, 3, 64)
    for bad in (True, 1.0, 2, -1):
        with pytest.raises(ValueError, match=r"specialist must be in \[0, 2\)"):
            draft(input_ids=PROMPT[:, :3], target_hidden_states=features, specialist=bad)
    out = draft(input_ids=PROMPT[:, :3], target_hidden_states=features, specialist=torch.tensor(1))
    torch.testing.assert_close(out.last_hidden_state,
                               draft(input_ids=PROMPT[:, :3], target_hidden_states=features, specialist=1).last_hidden_state)


def test_token_map_of_floats_is_refused(target):
    from transformers_poss.vocab import set_token_map

    with pytest.raises(ValueError, match="token map ids must be integers"):
        set_token_map(tiny_draft(target), torch.tensor([1.5, 2.5]))


def test_device_checks_before_loading():
    from transformers_poss.checks import check_device

    check_device("cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        check_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is available here; use --device cpu"):
            check_device("cuda")
    with pytest.raises(ValueError, match="--quantize int8 is the lossless CPU path"):
        check_device("meta", "int8")


def test_empty_draft_path():
    from transformers_poss.loading_checks import check_draft_source

    with pytest.raises(ValueError, match="an empty name was given as the draft folder"):
        check_draft_source("")


def test_embedded_prefix_gets_a_did_you_mean():
    from transformers_poss.embedded import load_target

    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        load_target("smollm2")


def test_checkpoints_appear_only_once_complete(tmp_path, monkeypatch):
    from transformers import Trainer

    from test_training_trainer import _args, _sequences
    from transformers_poss.training.checkpoints import last_complete_checkpoint
    from transformers_poss.training.trainer import PosSTrainer

    target = tiny_llama()
    out = tmp_path / "out"

    def trainer():
        args = _args(tmp_path, output_dir=str(out), max_steps=6, save_strategy="steps", save_steps=3)
        return PosSTrainer(model=tiny_draft(target).train(), args=args, target=target, train_dataset=_sequences(24))

    saves = []
    original = Trainer._save_rng_state

    def killed_on_second_save(self, output_dir):
        saves.append(output_dir)
        if len(saves) == 2:
            raise KeyboardInterrupt  # the process dies while checkpoint-6 is being written
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", killed_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        trainer().train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]
    assert (out / ".staging" / "checkpoint-6").is_dir()  # the half-written one never got its final name
    assert last_complete_checkpoint(out) == str(out / "checkpoint-3")
    monkeypatch.setattr(Trainer, "_save_rng_state", original)
    trainer().train(resume_from_checkpoint=last_complete_checkpoint(out))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-6"]
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6


def test_atomic_checkpoints_keep_the_save_total_limit(tmp_path):
    from test_training_trainer import _args, _sequences
    from transformers_poss.training.trainer import PosSTrainer

    target = tiny_llama()
    args = _args(tmp_path, output_dir=str(tmp_path / "out"), max_steps=6, save_strategy="steps", save_steps=2,
                 save_total_limit=2)
    PosSTrainer(model=tiny_draft(target).train(), args=args, target=target, train_dataset=_sequences(24)).train()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-4", "checkpoint-6"]


def test_official_config_without_hidden_size(tmp_path, target):
    folder = _write(tmp_path / "PosS2-tiny", _official_state(target, layers=2))
    config = json.loads((folder / "config.json").read_text())
    config.pop("hidden_size")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json lacks hidden_size: not the config of a PosS"):
        PosSDraftModel.from_official(str(folder), target=target)
