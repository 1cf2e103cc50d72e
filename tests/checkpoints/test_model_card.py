"""A draft's card is publishable as saved: licence, base_model, the Hub id or a placeholder, no local paths."""

import json

from huggingface_hub import ModelCard

from helpers import tiny_draft, tiny_llama
from transformers_poss.checkpoints.model_card import PLACEHOLDER_REPO, base_model_id, portable, render_model_card


def _draft_for(target_name_or_path):
    draft = tiny_draft(tiny_llama())
    draft.config.target_name_or_path = target_name_or_path
    return draft


def test_local_save_names_no_local_folder(tmp_path):
    folder = tmp_path / "runs" / "my-final-draft"
    _draft_for("HuggingFaceTB/SmolLM2-135M-Instruct").save_pretrained(folder)
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.license == "apache-2.0"  # the target's licence
    assert f'from_pretrained("{PLACEHOLDER_REPO}")' in card.text
    assert "my-final-draft" not in str(card) and str(tmp_path) not in str(card)


def test_hub_id_names_the_draft_and_its_model_index():
    draft = _draft_for("HuggingFaceTB/SmolLM2-135M-Instruct")
    draft.model_card_metrics = {"eval_acc_1": 0.7}
    card = render_model_card(draft, repo="me/poss2-smollm2")
    assert 'from_pretrained("me/poss2-smollm2")' in card
    assert "- name: poss2-smollm2" in card


def test_embedded_cache_folder_and_saved_hub_folder_give_base_model(tmp_path):
    cache = tmp_path / "smollm2-135m-instruct"
    cache.mkdir()
    assert base_model_id(str(cache)) == "HuggingFaceTB/SmolLM2-135M-Instruct"  # a quick-start draft
    saved = tmp_path / "my-target"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({"_name_or_path": "org/model"}))
    assert base_model_id(str(saved)) == "org/model"
    card = render_model_card(_draft_for(str(cache)))
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and str(tmp_path) not in card


def test_recipe_paths_are_cut_to_their_names():
    recipe = {"output_dir": "/home/me/runs/poss2", "data": {"train": ["/data/conv.jsonl", "rel/x.jsonl"]}, "lr": 1e-3}
    assert portable(recipe) == {"output_dir": ".../poss2", "data": {"train": [".../conv.jsonl", "rel/x.jsonl"]},
                                "lr": 1e-3}
