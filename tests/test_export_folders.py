"""Export and convert never lose files: non-empty folders need --overwrite, the draft's own folder is refused, a
failed write changes nothing; a custom_generate folder works after a copy or move; round trips keep the token map
and the tree settings."""

import json
import shutil

import pytest
import torch

from helpers import save_tiny_target, tiny_draft, tiny_llama
from transformers_poss import PosSDraftModel
from transformers_poss.cli import main
from transformers_poss.checkpoints.export import EAGLE_TOKEN_MAP_FILE, export_custom_generate, export_eagle
from transformers_poss.checkpoints.export_eagle3 import export_eagle3
from transformers_poss.checkpoints.folders import check_output_folder, staged_folder


def _pair(**kwargs):
    target = tiny_llama()
    return target, tiny_draft(target, num_specialists=1, **kwargs)


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fmt", ["eagle", "eagle3", "custom_generate"])
def test_export_into_a_target_folder_is_refused_and_changes_nothing(tmp_path, capsys, fmt):
    target, draft = _pair()
    if fmt == "eagle3":
        target = tiny_llama(layers=4)
        draft = tiny_draft(target, num_specialists=1, feature_layers=[1, 2, 4], layer_style="eagle3", own_lm_head=True)
    save_tiny_target(tmp_path / "target", target)
    draft.save_pretrained(tmp_path / "draft")
    before = _files(tmp_path / "target")
    assert main(["export", str(tmp_path / "draft"), "--output", str(tmp_path / "target"), "--format", fmt]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite" in err and "Traceback" not in err
    assert _files(tmp_path / "target") == before
    export = {"eagle": export_eagle, "eagle3": export_eagle3, "custom_generate": export_custom_generate}[fmt]
    with pytest.raises(FileExistsError, match="config.json"):
        export(draft, tmp_path / "target")
    assert _files(tmp_path / "target") == before


def test_overwrite_replaces_only_the_exported_files(tmp_path):
    _, draft = _pair()
    out = tmp_path / "eagle"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    export_eagle(draft, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert not any(p.name.startswith(".partial") for p in out.iterdir())


@pytest.mark.parametrize("fmt", ["eagle", "custom_generate"])
def test_export_into_the_drafts_own_folder(tmp_path, capsys, fmt):
    _, draft = _pair()
    draft.save_pretrained(tmp_path / "draft")
    before = _files(tmp_path / "draft")
    argv = ["export", str(tmp_path / "draft"), "--output", str(tmp_path / "draft"), "--format", fmt]
    assert main(argv) == 2  # not empty
    assert _files(tmp_path / "draft") == before
    if fmt == "eagle":  # would replace the draft by another format: refused even with --overwrite
        assert main(argv + ["--overwrite"]) == 2
        assert "the folder the draft is read from" in capsys.readouterr().err
        assert _files(tmp_path / "draft") == before
    else:  # the same draft, plus custom_generate/: allowed with --overwrite, the draft still loads
        assert main(argv + ["--overwrite"]) == 0
        assert (tmp_path / "draft" / "custom_generate" / "generate.py").exists()
        again = PosSDraftModel.from_pretrained(tmp_path / "draft")
        for name, value in draft.state_dict().items():
            assert torch.equal(again.state_dict()[name], value), name


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_folder(tmp_path / "out") as staging:
            (staging / "a.txt").write_text("new")
            raise RuntimeError("disk full")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["a.txt"]
    assert (tmp_path / "out" / "a.txt").read_text() == "old"
    with pytest.raises(RuntimeError):
        with staged_folder(tmp_path / "new"):
            raise RuntimeError("disk full")
    assert not (tmp_path / "new").exists()  # a folder this write created is removed again


def test_check_output_folder_messages(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        check_output_folder(tmp_path / "file")
    assert check_output_folder(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # checking writes nothing


def test_custom_generate_folder_works_after_a_move(tmp_path):
    target, draft = _pair()
    draft.generation_config.tree_top_k = 3
    export_custom_generate(draft, tmp_path / "cg")
    code = (tmp_path / "cg" / "custom_generate" / "generate.py").read_text()
    assert str(tmp_path) not in code and "DEFAULT_DRAFT = None" in code
    shutil.move(tmp_path / "cg", tmp_path / "moved")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(7))
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    out = target.generate(ids, custom_generate=str(tmp_path / "moved"), trust_remote_code=True, max_new_tokens=10,
                          do_sample=False)
    assert torch.equal(out, plain)
    # a copy whose draft differs uses its own draft, not the one at the old path
    shutil.copytree(tmp_path / "moved", tmp_path / "copy")
    other = tiny_draft(target, num_specialists=1, seed=9)
    other.save_pretrained(tmp_path / "copy")
    from transformers_poss.checkpoints.export import _DRAFT_CACHE

    _DRAFT_CACHE.clear()
    out = target.generate(ids, custom_generate=str(tmp_path / "copy"), trust_remote_code=True, max_new_tokens=10,
                          do_sample=False)
    assert torch.equal(out, plain)
    assert str(tmp_path / "copy") in _DRAFT_CACHE and str(tmp_path / "moved") not in _DRAFT_CACHE


def test_eagle_round_trip_keeps_token_map_and_tree_settings(tmp_path, caplog):
    target, draft = _pair(draft_vocab_size=16, positions_per_specialist=3)
    with torch.no_grad():
        draft.draft_to_target.copy_(torch.arange(100, 116))
    draft.generation_config.tree_depth, draft.generation_config.tree_top_k = 5, 3
    draft.generation_config.tree_total_tokens = 12
    export_eagle(draft, tmp_path / "eagle")
    assert (tmp_path / "eagle" / EAGLE_TOKEN_MAP_FILE).exists()
    assert main(["convert", str(tmp_path / "eagle"), "--output", str(tmp_path / "back")]) == 0
    back = PosSDraftModel.from_pretrained(tmp_path / "back")
    assert back.config.draft_vocab_size == 16 and back.draft_to_target.tolist() == list(range(100, 116))
    assert back.config.positions_per_specialist == 3
    gen = back.generation_config
    assert (gen.tree_depth, gen.tree_top_k, gen.tree_total_tokens) == (5, 3, 12)
    # reduced_vocab="full": the format cannot hold the map, and the export says so
    with caplog.at_level("WARNING"):
        export_eagle(draft, tmp_path / "full", reduced_vocab="full")
    assert "is not written" in caplog.text
    assert PosSDraftModel.from_official(str(tmp_path / "full"), target=target).draft_to_target is None


def test_eagle3_round_trip_keeps_tree_settings(tmp_path):
    target = tiny_llama(layers=4)
    draft = tiny_draft(target, num_specialists=1, feature_layers=[1, 2, 4], layer_style="eagle3", own_lm_head=True,
                       draft_vocab_size=32)
    draft.generation_config.tree_total_tokens = "auto"
    draft.generation_config.tree_depth = 7
    export_eagle3(draft, tmp_path / "e3")
    back = PosSDraftModel.from_official(str(tmp_path / "e3"), target=target)
    assert back.generation_config.tree_total_tokens == "auto" and back.generation_config.tree_depth == 7
    assert torch.equal(back.draft_to_target, draft.draft_to_target)


def test_convert_refuses_a_non_empty_output(tmp_path, capsys):
    _, draft = _pair()
    export_eagle(draft, tmp_path / "eagle")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert main(["convert", str(tmp_path / "eagle"), "--output", str(tmp_path / "out")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "eagle"), "--output", str(tmp_path / "out"), "--overwrite"]) == 0
    assert (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").exists()
