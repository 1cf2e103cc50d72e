"""Bad inputs get a short error that says what to do; nothing is silently wrong (drafts, configs, loading)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from helpers import tiny_draft, tiny_llama
from test_official import _official_state, _write
from transformers_poss import PosSDraftConfig, PosSDraftModel

PROMPT = torch.tensor([[1, 5, 9, 3, 7, 2]])


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


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


def test_near_miss_of_an_embedded_name():
    from transformers_poss.embedded import load_target

    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        load_target("smollm2-135m")


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
    from transformers_poss.checkpoints.loading import check_draft_source

    with pytest.raises(ValueError, match="an empty name was given as the draft folder"):
        check_draft_source("")


def test_embedded_prefix_gets_a_did_you_mean():
    from transformers_poss.embedded import load_target

    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        load_target("smollm2")


def test_official_config_without_hidden_size(tmp_path, target):
    folder = _write(tmp_path / "PosS2-tiny", _official_state(target, layers=2))
    config = json.loads((folder / "config.json").read_text())
    config.pop("hidden_size")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json lacks hidden_size: not the config of a PosS"):
        PosSDraftModel.from_official(str(folder), target=target)
