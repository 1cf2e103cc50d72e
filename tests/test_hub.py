"""Hub round trips of drafts, offline: huggingface_hub's upload calls are intercepted and the files they receive
are checked (the draft's own card, its tree shape, its training recipe)."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.utils import filter_repo_objects

from helpers import tiny_draft, tiny_llama
from transformers_poss import PosSDraftModel

RECIPE = {"config": {"target": "HuggingFaceTB/SmolLM2-135M-Instruct", "data": {"train": ["conv.jsonl"]}},
          "eval": {"eval_loss": 0.5, "eval_acc_1": 0.7, "eval_accept_2": 0.6, "eval_chain_tau": 2.1, "epoch": 3.0}}


class FakeHub:
    """Records what would reach the Hub: repos created, and every upload's files (name -> bytes)."""

    def __init__(self, monkeypatch):
        self.repos, self.uploads, self.branches = [], [], []
        hub = self

        def create_repo(api, repo_id, **kwargs):
            hub.repos.append((repo_id, kwargs))
            return SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

        def create_branch(api, repo_id, *, branch, **kwargs):
            hub.branches.append((repo_id, branch))

        def upload_folder(api, *, repo_id, folder_path, allow_patterns=None, ignore_patterns=None, **kwargs):
            names = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
            names = list(filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
            files = {name: (Path(folder_path) / name).read_bytes() for name in names}
            hub.uploads.append({"repo_id": repo_id, "files": files, **kwargs})
            return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0", oid="0", pr_url=None)

        def refuse(api, *args, **kwargs):
            raise AssertionError("no other Hub call is expected offline")

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_branch", create_branch)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(HfApi, "create_commit", refuse)
        monkeypatch.setattr(HfApi, "upload_file", refuse)

    def last(self, name):
        return self.uploads[-1]["files"][name]

    def card(self):
        return ModelCard(self.last("README.md").decode())

    def json(self, name):
        return json.loads(self.last(name))


@pytest.fixture
def fake_hub(monkeypatch):
    return FakeHub(monkeypatch)


def _draft(**kwargs):
    target = tiny_llama()
    target.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    draft = tiny_draft(target, **kwargs)
    draft.config.target_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    draft.generation_config.tree_depth = 5
    draft.generation_config.tree_top_k = 3
    draft.generation_config.tree_total_tokens = 12
    return draft


def _check_draft_files(hub, draft, tags=()):
    files = hub.uploads[-1]["files"]
    assert {"model.safetensors", "config.json", "generation_config.json", "README.md"} <= set(files)
    gen = hub.json("generation_config.json")
    assert (gen["tree_depth"], gen["tree_top_k"], gen["tree_total_tokens"]) == (5, 3, 12)
    assert hub.json("config.json")["model_type"] == "poss_draft"
    card = hub.card()
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.library_name == "transformers-poss" and card.data.pipeline_tag == "text-generation"
    assert {"speculative-decoding", "poss", *tags} <= set(card.data.tags)
    assert f"| specialists (S) | {draft.config.num_specialists} |" in card.text
    assert "| default tree (depth / top-k / total tokens) | 5 / 3 / 12 |" in card.text
    return card


def test_push_to_hub_uploads_the_drafts_own_card_and_tree_shape(fake_hub):
    draft = _draft(num_specialists=3, positions_per_specialist=2)
    draft.add_model_tags(["from-model-tags"])
    draft.push_to_hub("user/poss2-tiny", tags=["my-tag"], commit_message="first", private=True)
    assert fake_hub.repos[0][0] == "user/poss2-tiny" and fake_hub.repos[0][1]["private"] is True
    assert fake_hub.uploads[-1]["commit_message"] == "first"
    card = _check_draft_files(fake_hub, draft, tags=["my-tag", "from-model-tags"])
    assert 'PosSDraftModel.from_pretrained("user/poss2-tiny")' in card.text
    assert "| training depth (S x N) | 6 |" in card.text
    assert "training_recipe.json" not in fake_hub.uploads[-1]["files"]  # none set


def test_card_and_recipe_survive_load_save_push(tmp_path, fake_hub):
    draft = _draft(num_specialists=2)
    draft.model_card_extra = "## Measured\n\nHand-written figures that must survive."
    draft.training_recipe = RECIPE
    draft.save_pretrained(tmp_path / "a", tags=["first-save"])
    loaded = PosSDraftModel.from_pretrained(tmp_path / "a")
    assert loaded.training_recipe == RECIPE
    assert loaded.model_card_extra.strip() == draft.model_card_extra
    loaded.save_pretrained(tmp_path / "b")
    again = PosSDraftModel.from_pretrained(tmp_path / "b")
    again.push_to_hub("user/round-trip")

    card = _check_draft_files(fake_hub, again, tags=["first-save"])
    assert card.text.count("Hand-written figures that must survive.") == 1  # kept once, not duplicated
    assert fake_hub.json("training_recipe.json") == RECIPE
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results == {"eval_loss": 0.5, "eval_acc_1": 0.7, "eval_accept_2": 0.6, "eval_chain_tau": 2.1}
    for (name, a), (_, b) in zip(draft.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_card_of_an_older_template_keeps_its_hand_written_part(tmp_path):
    shipped = Path(__file__).resolve().parents[1] / "drafts" / "eagle2-smollm2-135m-instruct"
    draft = PosSDraftModel.from_pretrained(shipped)
    assert draft.training_recipe["eval"]["eval_acc_1"] > 0
    assert draft.model_card_extra.startswith("## What this draft is and why it ships")
    draft.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.text.count("## What this draft is and why it ships") == 1
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # embedded name -> its Hub repo
    assert json.loads((tmp_path / "training_recipe.json").read_text()) == draft.training_recipe


def test_a_foreign_card_is_kept_below_the_generated_part(tmp_path):
    draft = _draft()
    draft.save_pretrained(tmp_path)
    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- mine\n---\n\n# My own notes\n\nKeep me.\n")
    loaded = PosSDraftModel.from_pretrained(tmp_path)
    loaded.save_pretrained(tmp_path / "again")
    card = ModelCard.load(tmp_path / "again" / "README.md")
    assert card.data.license == "apache-2.0" and "mine" in card.data.tags
    assert "Keep me." in card.text and "| specialists (S) |" in card.text


def test_save_pretrained_push_to_hub_uploads_the_drafts_files(tmp_path, fake_hub):
    draft = _draft()
    draft.training_recipe = RECIPE
    (tmp_path / "unrelated.txt").write_text("not part of the draft")
    draft.save_pretrained(tmp_path, push_to_hub=True, repo_id="user/saved", commit_message="save", tags=["t1"])
    assert [r[0] for r in fake_hub.repos] == ["user/saved"]
    upload = fake_hub.uploads[-1]
    assert upload["repo_id"] == "user/saved" and upload["commit_message"] == "save"
    assert "unrelated.txt" not in upload["files"]  # only what this save wrote
    card = _check_draft_files(fake_hub, draft, tags=["t1"])
    assert "transformers model that has been pushed" not in card.text  # not transformers' generic card
    assert fake_hub.json("training_recipe.json") == RECIPE


def test_push_to_a_branch_creates_it(fake_hub):
    _draft().push_to_hub("user/branchy", revision="v2")
    assert fake_hub.branches == [("user/branchy", "v2")]
    assert fake_hub.uploads[-1]["revision"] == "v2"


def _stored(target, count=8):
    from transformers_poss.training.features import TargetFeatures

    generator = torch.Generator().manual_seed(0)
    features = TargetFeatures(target)
    items = []
    for _ in range(count):
        tokens = torch.randint(3, 128, (14,), generator=generator)
        mask = torch.zeros(14, dtype=torch.long)
        mask[5:] = 1
        items.append({"input_ids": tokens, "assistant_mask": mask, "hidden_states": features(tokens[None])[0]})
    return items


@pytest.mark.parametrize("trainer_kind", ["plain", "poss"])
def test_trainer_push_to_hub_uploads_the_drafts_card(tmp_path, fake_hub, trainer_kind):
    from transformers import Trainer, TrainingArguments

    from transformers_poss.training.features import PosSDataCollator
    from transformers_poss.training.trainer import PosSTrainer, PosSTrainingArguments

    target = tiny_llama()
    target.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    draft = _draft(num_specialists=2).attach_target(target).train()
    common = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, save_strategy="no",
                  report_to="none", use_cpu=True, disable_tqdm=True, push_to_hub=True, hub_model_id="user/trained")
    if trainer_kind == "plain":
        trainer = Trainer(model=draft, args=TrainingArguments(**common), train_dataset=_stored(target),
                          eval_dataset=_stored(target, 4), data_collator=PosSDataCollator())
    else:
        trainer = PosSTrainer(model=draft, args=PosSTrainingArguments(**common), target=target,
                              train_dataset=_stored(target), eval_dataset=_stored(target, 4))
    trainer.train()
    trainer.evaluate()
    trainer.push_to_hub(tags=["trained-tag"], dataset="my-org/my-conversations")
    upload = fake_hub.uploads[-1]
    assert upload["repo_id"] == "user/trained"
    card = _check_draft_files(fake_hub, draft, tags=["trained-tag"])
    assert "| training depth (S x N) | 2 |" in card.text
    assert "This model is a fine-tuned version" not in card.text  # the Trainer's generic summary is not used
    assert card.data.datasets == ["my-org/my-conversations"]
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results["eval_loss"] > 0
    assert not any(name.startswith("checkpoint-") for name in upload["files"])


def test_other_models_keep_the_trainers_card(tmp_path, fake_hub):
    from transformers import Trainer, TrainingArguments

    tiny_draft(tiny_llama()).save_pretrained(tmp_path / "draft")  # installs the card hook
    model = tiny_llama()
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "lm"), report_to="none",
                                                          use_cpu=True))
    trainer.create_model_card(model_name="lm")
    text = (tmp_path / "lm" / "README.md").read_text()
    assert "transformers-poss" not in text and os.path.getsize(tmp_path / "lm" / "README.md") > 0
