"""`poss generate` streams the answer to stdout as it is generated (transformers' TextStreamer); the text and the
generated tokens are the same as without streaming, with and without a draft."""

import pytest
from transformers import TextStreamer

from helpers import save_tiny_target, tiny_draft, tiny_llama
from transformers_poss import cli


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = tiny_llama(vocab_size=128, hidden_size=32)
    target.generation_config.eos_token_id = None  # always the full budget
    root = tmp_path_factory.mktemp("generate")
    tiny_draft(target).save_pretrained(root / "draft")
    return save_tiny_target(root / "target", target), root / "draft"


def _generate(capsys, argv):
    assert cli.main(["generate", *argv]) == 0
    return capsys.readouterr()


@pytest.mark.parametrize("with_draft", [False, True])
def test_generate_streams_the_same_text(folders, capsys, monkeypatch, with_draft):
    target, draft = folders
    argv = ["--target", str(target), "--max-new-tokens", "12", "w1 w2 w3 w1 w2 w3"]
    if with_draft:
        argv += ["--draft", str(draft), "--tree-depth", "2", "--tree-top-k", "2", "--tree-total-tokens", "4"]
    chunks = []
    finalized = TextStreamer.on_finalized_text

    def recording(self, text, stream_end=False):
        chunks.append((text, stream_end))
        finalized(self, text, stream_end)

    monkeypatch.setattr(TextStreamer, "on_finalized_text", recording)
    streamed = _generate(capsys, argv)
    assert len(chunks) > 2 and chunks[-1][1] and not any(end for _, end in chunks[:-1])  # piece by piece, then end
    assert streamed.out == "".join(text for text, _ in chunks) + "\n"  # stdout is what the streamer printed
    chunks.clear()
    whole = _generate(capsys, argv + ["--no-stream"])
    assert not chunks and whole.out == streamed.out and whole.out.strip()  # same text, printed once at the end
    assert "tokens/s" in streamed.err and "tokens/s" in whole.err  # speed goes to stderr either way
    if with_draft:
        assert "mean acceptance length" in streamed.err
        plain = _generate(capsys, argv[:5] + ["--no-stream"])
        assert plain.out == streamed.out  # tree speculation is lossless: the plain target's greedy text


def test_generate_quiet_streams_only_the_text(folders, capsys):
    target, _ = folders
    out = _generate(capsys, ["--target", str(target), "--max-new-tokens", "6", "--quiet", "w5 w6"])
    assert out.out.strip() and "tokens/s" not in out.err
