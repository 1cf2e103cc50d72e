"""`PosSDraftConfig.for_target` reads every causal LM config whatever it calls its sizes; targets the tree path
cannot serve (ALiBi positions, recurrent / state-space models) are refused up front, naming the architecture."""

import pytest
import torch
from transformers import (
    AutoConfig,
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTJForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from transformers_poss import PosSDraftConfig, PosSDraftModel

NO_ATTENTION = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "blt", "dots3_note", "dots3_note_text"}
ODD = {"reformer"}  # its default config fails transformers' own rope validation for the draft's head size


@pytest.mark.parametrize("model_type", sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - ODD))
def test_for_target_reads_every_causal_lm_config(model_type):
    try:
        config = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - a config that needs arguments to exist at all
        pytest.skip(f"{model_type}: no default config")
    if model_type in NO_ATTENTION:
        with pytest.raises(ValueError, match=f"the '{config.get_text_config(decoder=True).model_type}' config names no"):
            PosSDraftConfig.for_target(config)
        return
    draft = PosSDraftConfig.for_target(config)
    assert draft.hidden_size > 0 and draft.intermediate_size > 0 and draft.num_attention_heads > 0


def test_sizes_under_other_names():
    gpt2 = PosSDraftConfig.for_target(GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=256))
    assert (gpt2.hidden_size, gpt2.num_attention_heads, gpt2.target_num_hidden_layers) == (64, 4, 3)
    assert gpt2.intermediate_size == 256 and gpt2.max_position_embeddings == 256  # n_inner None: 4 * hidden
    opt = PosSDraftConfig.for_target(OPTConfig(hidden_size=64, num_attention_heads=4, ffn_dim=96))
    assert opt.intermediate_size == 96


def _lossless_or_error(model):
    torch.manual_seed(1)
    draft = PosSDraftModel(PosSDraftConfig.for_target(model.config, num_specialists=2)).eval().attach_target(model)
    draft.generation_config.tree_total_tokens = 8
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(2))
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False), plain)


@pytest.mark.parametrize("make", [
    lambda: GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    lambda: OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     ffn_dim=128, word_embed_proj_dim=64)),
    lambda: GPTJForCausalLM(GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                       n_positions=128)),
    lambda: FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
], ids=["gpt2-learned", "opt-learned", "gptj-rotary", "falcon-rotary"])
def test_learned_and_rotary_positions_are_served_losslessly(make):
    torch.manual_seed(0)
    _lossless_or_error(make().eval())


@pytest.mark.parametrize("make, name", [
    (lambda: BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)), "bloom"),
    (lambda: FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, alibi=True)), "falcon"),
])
def test_alibi_targets_are_refused_before_any_work(make, name):
    torch.manual_seed(0)
    model = make().eval()
    with pytest.raises(ValueError, match=f"cannot serve this target: the '{name}' target uses ALiBi"):
        _lossless_or_error(model)
