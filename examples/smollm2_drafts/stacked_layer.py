"""Is a deeper draft more accurate? `poss train` with a second decoder layer stacked on each one-step draft layer.

The draft's layer becomes [`StackedLayer`]: the trained layer, then a new Llama-style layer (input norm, attention,
MLP) whose output projections start at zero, so the stacked draft starts exactly where the trained one is. The new
layer learns at ``--extra_lr_scale`` x the learning rate. Only the training path of the one-step layout
(``--num_specialists 1 --positions_per_specialist 1``) is covered: drafting, export and the multi-step unroll read a
layer's keys from its input, which a stacked layer's upper half does not have, so the saved draft (``layers.0.base``,
``layers.0.extra``) is for this measurement only and `PosSDraftModel` does not load it. Every other argument is
`poss train`'s, and the held-out accuracy is in ``OUTPUT_DIR/final/training_recipe.json`` ("eval"):

    python examples/smollm2_drafts/stacked_layer.py --extra_lr_scale 5 --config examples/smollm2_drafts/recipe.yaml \
        --num_specialists 1 --positions_per_specialist 1 --init_from RUNS/smollm2-eagle2c/final --output_dir OUT ...
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from transformers_poss.modeling_poss_layers import PosSDecoderLayer
from transformers_poss.training import cli
from transformers_poss.training.trainer import PosSTrainer


class StackedLayer(nn.Module):
    """``base`` (an ``eagle2``-style layer) followed by a new layer over its normalised output.

    Keys and values of the base come from the fused pairs as before (``project_kv``); the upper layer projects its
    own from the base's output, so it attends causally over the same rows (the one-step training masks)."""

    def __init__(self, base: nn.Module, config):
        super().__init__()
        self.base = base
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.extra = PosSDecoderLayer(config)
        with torch.no_grad():  # residual branches start at zero: the stack starts as the base
            self.extra.self_attn.o_proj.weight.zero_()
            self.extra.mlp.down_proj.weight.zero_()

    def project_kv(self, hidden_states, position_embeddings):
        return self.base.project_kv(hidden_states, position_embeddings)

    def forward(self, hidden_states, position_embeddings, keys, values, attention_mask) -> torch.Tensor:
        """`[B, T, H]` fused pairs -> `[B, T, H]` predicted features."""
        lower = self.base(hidden_states, position_embeddings, keys, values, attention_mask)
        normed = self.input_layernorm(lower)
        upper_keys, upper_values = self.extra.project_kv(normed, position_embeddings)
        attended = lower + self.extra.self_attn(normed, position_embeddings, upper_keys, upper_values, attention_mask)
        return attended + self.extra.mlp(self.extra.post_attention_layernorm(attended))

    def new_modules(self) -> list[nn.Module]:
        return [self.input_layernorm, self.extra]


def stack_layers(draft) -> None:
    """Wrap every specialist layer of a one-step ``eagle2``-style draft in a [`StackedLayer`]."""
    if draft.config.layer_style != "eagle2" or draft.config.training_depth != 1:
        raise SystemExit("stacked_layer.py covers the one-step eagle2 layout only: pass --num_specialists 1 "
                         "--positions_per_specialist 1 (and no --layer_style eagle3).")
    for index, layer in enumerate(draft.layers):
        draft.layers[index] = StackedLayer(layer, draft.config)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--extra_lr_scale", type=float, default=5.0,
                        help="learning rate of the new layer relative to --learning_rate")
    known, rest = parser.parse_known_args(argv)
    build_draft, scaled_modules = cli.build_draft, PosSTrainer._scaled_modules

    def stacked_draft(config, target, train_dataset, tokenizer):
        draft = build_draft(config, target, train_dataset, tokenizer)
        stack_layers(draft)
        return draft

    def with_new_layers(draft, args):
        new = [(module, known.extra_lr_scale) for layer in draft.layers for module in layer.new_modules()]
        return scaled_modules(draft, args) + new

    cli.build_draft = stacked_draft
    PosSTrainer._scaled_modules = staticmethod(with_new_layers)
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
