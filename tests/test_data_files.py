"""Every command that reads data reads the files the project writes (`.jsonl.gz`), and a bad file is named with its
line and what to do: bytes that are not UTF-8, cut-off gzip data, no usable conversation, an empty prompt row."""

import gzip
import io
import json
from pathlib import Path

import pytest
import torch

from transformers_poss.bench.run import load_questions
from transformers_poss.cli.generate import read_prompt
from transformers_poss.cli.vocab import corpus_texts
from transformers_poss.textfiles import read_lines
from transformers_poss.training.data import load_conversations
from transformers_poss.training.distill import read_jsonl
from helpers import example_module

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m-instruct"


def _gz(path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))
    return path


def test_the_projects_own_data_files_are_read_everywhere():
    conversations = DATA / "conversations.jsonl.gz"
    texts = corpus_texts([str(conversations)])  # poss vocab --corpus
    assert next(texts).strip()
    assert len(load_conversations(str(conversations), limit=3)) == 3  # poss train --train
    prompts = read_jsonl(DATA / "prompts.jsonl.gz")  # poss train --prompts
    assert prompts and isinstance(prompts[0]["prompt"], str)


def test_gzip_question_file_for_bench(tmp_path):
    path = _gz(tmp_path / "q.jsonl.gz", [json.dumps({"question_id": i, "turns": [f"question {i}"]}) for i in range(3)])
    assert [q["text"] for q in load_questions([path])] == ["question 0", "question 1", "question 2"]


def test_compression_is_recognised_by_content_not_name(tmp_path):
    path = _gz(tmp_path / "corpus.jsonl", [json.dumps({"text": "hello"})])
    assert list(corpus_texts([str(path)])) == ["hello"]


@pytest.mark.parametrize("compressed", [False, True])
def test_a_line_that_is_not_utf8_is_named(tmp_path, compressed):
    raw = b'{"text": "fine"}\n{"text": "caf\xe9"}\n'
    path = tmp_path / ("c.jsonl.gz" if compressed else "c.jsonl")
    path.write_bytes(gzip.compress(raw) if compressed else raw)
    with pytest.raises(ValueError, match=r"c\.jsonl(\.gz)?:2: not UTF-8 text \(byte 0xe9 at column 14\); save"):
        list(corpus_texts([str(path)]))
    with pytest.raises(ValueError, match=":2: not UTF-8"):
        load_conversations(str(path))
    questions = tmp_path / "q.jsonl"
    questions.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["\xff"]}\n')
    with pytest.raises(ValueError, match=r"q\.jsonl:2: not UTF-8 text"):
        load_questions([questions])


def test_cut_off_gzip_data(tmp_path):
    whole = gzip.compress(b"".join(json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(400)))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: cannot be read after line \d+: the gzip data is truncated"):
        list(read_lines(path))


def test_a_data_file_with_no_usable_conversation(tmp_path):
    path = tmp_path / "users-only.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"users-only\.jsonl: no usable conversation \(1 example\(s\), none with an "
                                         r"assistant message\)"):
        load_conversations(str(path))


def test_non_utf8_prompts_are_refused_with_the_byte():
    with pytest.raises(ValueError, match=r"prompt on stdin is not UTF-8 text \(byte 0xff at offset 3\)"):
        read_prompt(None, io.BytesIO(b"abc\xff"))
    assert read_prompt(None, io.BytesIO("\ufeffhé".encode())) == "hé"
    with pytest.raises(ValueError, match="prompt argument is not UTF-8"):
        read_prompt("caf\udce9")


def test_non_utf8_prompt_on_the_command_line(capsys, monkeypatch):
    from transformers_poss.cli import main

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad")))
    assert main(["generate", "--target", "./no-such-target"]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8 text" in err and "Traceback" not in err


def test_an_empty_row_in_a_batch_is_named():
    from helpers import tiny_draft, tiny_llama

    target = tiny_llama()
    draft = tiny_draft(target)
    ids = torch.randint(3, 100, (3, 5))
    mask = torch.ones_like(ids)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"Row\(s\) \[1\] of the batch are empty"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, do_sample=False,
                        pad_token_id=0)  # fmt: skip


@pytest.mark.parametrize("key, value", [("hidden_size", "64"), ("num_specialists", "2"),
                                        ("positions_per_specialist", "1")])
def test_a_config_number_written_as_a_string_is_named(tmp_path, key, value):
    from helpers import tiny_draft, tiny_llama
    from transformers_poss import PosSDraftModel

    tiny_draft(tiny_llama()).save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config[key] = value
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json: `{key}` is the string '{value}'; write it as a number"):
        PosSDraftModel.from_pretrained(tmp_path / "d")


def test_split_data_holds_out_only_unseen_conversations_and_keeps_a_users_file(tmp_path):
    """`examples/smollm2_drafts/split_data.py`: held-out conversations come from after ``--seen``, train + held-out
    is the whole file, a second run with the same settings changes nothing, and a different file is never overwritten."""
    split = example_module("split_data")
    with gzip.open(DATA / "conversations.jsonl.gz", "rt", encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    seen = len(lines) - 50
    upto = ["--heldout-upto", str(len(lines))]
    assert split.main(["--out", str(tmp_path), "--seen", str(seen), "--heldout", "20", *upto]) == 0
    with gzip.open(tmp_path / "train.jsonl.gz", "rt", encoding="utf-8") as handle:
        train = handle.readlines()
    with gzip.open(tmp_path / "heldout.jsonl.gz", "rt", encoding="utf-8") as handle:
        held = handle.readlines()
    assert len(held) == 20 and set(held) <= set(lines[seen:])
    # every conversation once: as it is, or in its two-turn form where a follow-up continues it (then it starts alike)
    by_id, originals = {json.loads(line)["id"]: json.loads(line) for line in lines}, set(lines)
    assert sorted(json.loads(line)["id"] for line in train + held) == sorted(by_id)
    for line in train:
        record = json.loads(line)
        if record.get("followup"):
            assert record["messages"][: len(by_id[record["id"]]["messages"])] == by_id[record["id"]]["messages"]
        else:
            assert line in originals
    assert train[:len(lines) - 70] != lines[:len(lines) - 70]  # shuffled
    assert split.main(["--out", str(tmp_path), "--seen", str(seen), "--heldout", "20", *upto]) == 0  # kept
    with pytest.raises(SystemExit, match="exists with other conversations"):
        split.main(["--out", str(tmp_path), "--seen", str(seen), "--heldout", "20", "--seed", "1", *upto])
    with gzip.open(tmp_path / "train.jsonl.gz", "rt", encoding="utf-8") as handle:
        assert handle.readlines() == train


def test_split_data_keeps_the_same_held_out_conversations_as_the_data_grows(tmp_path):
    """Conversations appended after ``--heldout-upto`` go to the training file; the held-out set is unchanged."""
    split = example_module("split_data")
    data = tmp_path / "data"
    data.mkdir()

    def line(i):
        return json.dumps({"id": i, "messages": [{"role": "user", "content": f"q{i}"},
                                                 {"role": "assistant", "content": f"a{i}"}]})

    _gz(data / "conversations.jsonl.gz", [line(i) for i in range(30)])
    flags = ["--data", str(data), "--seen", "5", "--heldout", "6", "--heldout-upto", "30"]
    assert split.main(["--out", str(tmp_path / "before"), *flags]) == 0
    _gz(data / "conversations.jsonl.gz", [line(i) for i in range(45)])
    assert split.main(["--out", str(tmp_path / "after"), *flags]) == 0

    def ids(folder, name):
        with gzip.open(tmp_path / folder / f"{name}.jsonl.gz", "rt", encoding="utf-8") as handle:
            return {json.loads(row)["id"] for row in handle}

    assert ids("after", "heldout") == ids("before", "heldout") and len(ids("after", "heldout")) == 6
    assert ids("after", "train") == set(range(45)) - ids("after", "heldout")
    with pytest.raises(SystemExit):  # too few conversations between --seen and --heldout-upto
        split.main(["--out", str(tmp_path / "x"), "--data", str(data), "--seen", "28", "--heldout", "6",
                    "--heldout-upto", "30"])


def test_split_data_trains_on_the_two_turn_form_of_followed_up_conversations(tmp_path):
    """A conversation continued with a follow-up turn is trained on in its two-turn form (in place of the one-turn
    one, never both); held-out conversations stay one-turn and no follow-up of theirs reaches the training file."""
    split = example_module("split_data")
    data = tmp_path / "data"
    data.mkdir()

    def turn(i):
        return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]

    order = [3, 0, 7, 1, 9, 2, 8, 4, 6, 5]  # answers are written out of id order
    _gz(data / "conversations.jsonl.gz", [json.dumps({"id": i, "messages": turn(i)}) for i in order])
    sources = [7, 2, 9, 4]  # 2 asked nothing usable
    _gz(data / "followup-prompts.jsonl.gz", [json.dumps({"source": s, "messages": None if s == 2 else
                                                          turn(s) + [{"role": "user", "content": f"more on {s}"}]})
                                              for s in sources])
    more = {s: turn(s) + [{"role": "user", "content": f"more on {s}"}, {"role": "assistant", "content": f"more {s}"}]
            for s in (7, 9, 4)}
    _gz(data / "followups.jsonl.gz", [json.dumps({"id": k, "messages": more[s]}) for k, s in enumerate((7, 9, 4))])
    assert split.main(["--out", str(tmp_path / "out"), "--data", str(data), "--seen", "5", "--heldout", "3"]) == 0
    with gzip.open(tmp_path / "out" / "train.jsonl.gz", "rt", encoding="utf-8") as handle:
        train = [json.loads(line) for line in handle]
    with gzip.open(tmp_path / "out" / "heldout.jsonl.gz", "rt", encoding="utf-8") as handle:
        held = [json.loads(line) for line in handle]
    assert sorted(r["id"] for r in train + held) == list(range(10))  # each conversation once
    held_ids = {r["id"] for r in held}
    assert all(len(r["messages"]) == 2 for r in held)
    for record in train:
        expected = more[record["id"]] if record["id"] in more else turn(record["id"])
        assert record["messages"] == expected
    assert sum(len(r["messages"]) == 4 for r in train) == len(set(more) - held_ids) >= 1


def test_committed_data_holds_no_evaluation_prompt_and_no_repeated_prompt():
    """Every user turn of the committed data (prompts, answered conversations, follow-ups) is checked against the
    MT-Bench turns shipped with the package, and the synthesised prompts are distinct (normalised as the synthesis
    normalises them)."""
    from transformers_poss.bench.run import bundled_questions
    from transformers_poss.training.distill import _normalized

    evaluation = {_normalized(turn) for line in bundled_questions().read_text(encoding="utf-8").splitlines()
                  if line.strip() for turn in json.loads(line)["turns"]}
    assert len(evaluation) >= 150
    prompts = [_normalized(r["prompt"]) for r in read_jsonl(DATA / "prompts.jsonl.gz")]
    assert len(set(prompts)) == len(prompts) and not set(prompts) & evaluation
    # answered conversations: the first user turn of each is the prompt of its id (prompts may wait for answers)
    answered = read_jsonl(DATA / "conversations.jsonl.gz")
    assert 0 < len(answered) <= len(prompts)
    assert all(_normalized(r["messages"][0]["content"]) == prompts[r["id"]] for r in answered)
    users = []
    for name in ("conversations.jsonl.gz", "followup-prompts.jsonl.gz", "followups.jsonl.gz"):
        if (DATA / name).exists():
            users += [_normalized(m["content"]) for r in read_jsonl(DATA / name) for m in r["messages"] or []
                      if m["role"] == "user"]
    assert len(users) >= len(answered) and not set(users) & evaluation
