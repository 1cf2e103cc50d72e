"""Tiny random models shared by the tests, and the example scripts loaded as modules."""

import importlib.util
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from transformers_poss import PosSDraftConfig, PosSDraftModel


def tiny_llama(vocab_size=128, hidden_size=64, layers=2, heads=4, kv_heads=2, seed=0, **kwargs):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        **kwargs,
    )
    return LlamaForCausalLM(config).eval()


def tiny_draft(target, num_specialists=2, positions_per_specialist=1, seed=1, **kwargs):
    torch.manual_seed(seed)
    config = PosSDraftConfig.for_target(
        target.config, num_specialists=num_specialists, positions_per_specialist=positions_per_specialist, **kwargs
    )
    draft = PosSDraftModel(config).eval().attach_target(target)
    draft.generation_config.tree_context_candidates = False  # the draft's own trees; tests of copies turn them on
    return draft


def motif_sequences(count=24, seed=0, vocab=128):
    """Token sequences with a learnable pattern (a repeated random motif) and an assistant span (training tests)."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(count):
        length = int(torch.randint(14, 30, (1,), generator=generator))
        motif = torch.randint(3, vocab, (5,), generator=generator)
        tokens = motif.repeat(length // 5 + 1)[:length]
        mask = torch.zeros(length, dtype=torch.long)
        mask[length // 3 :] = 1
        items.append({"input_ids": tokens, "assistant_mask": mask})
    return items


# ---------------------------------------------------------------------------------- folders the `poss` commands load
WORDS = [f"w{i}" for i in range(120)]


def save_tiny_target(folder, model):
    """Save `model` with a word-level tokenizer over `WORDS` and a chat template: a target folder for the commands."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "user", "assistant", ":"] + WORDS)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}user : {{ m['content'] }} {% endfor %}assistant :"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_questions(path, count, category):
    """A question file (mt_bench.jsonl format) of `count` prompts made of `WORDS`; returns its path as str."""
    import json

    text = "\n".join(json.dumps({"question_id": i, "category": category, "turns": [" ".join(WORDS[i:i + 5] * 2)]})
                     for i in range(count))
    path.write_text(text)
    return str(path)


# draft variants that read several target layers (EAGLE-3 style), for a tiny_llama(layers=4) target
FEATURE_VARIANTS = {
    "eagle2-fl": dict(feature_layers=[1, 2, 4]),
    "eagle3-fl": dict(feature_layers=[1, 2, 4], layer_style="eagle3"),
    "eagle3-fl-head": dict(feature_layers=[0, 3], layer_style="eagle3", own_lm_head=True),
    "eagle3-post-norm": dict(layer_style="eagle3"),
}


def randomize_norms(model, seed=3):
    """Give every RMSNorm weight of ``model`` random values (freshly built norms are all ones, which would hide a
    norm applied to the wrong tensor)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))
    return model


def selected_features(target, ids, layers):
    """`[B, T, k*H]`: the target's hidden states ``layers`` (None: the post-norm one) concatenated, for ``ids``."""
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in (layers or [-1])], dim=-1)


def example_module(name):
    """``examples/smollm2_drafts/NAME.py`` loaded as a module (the examples are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "smollm2_drafts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
