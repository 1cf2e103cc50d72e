"""PosS draft model: an EAGLE-style feature head with position-specialist decoder layers.

Read top-down: pretrained base -> model (target attachment, logits, the building blocks, forward, drafting, hub).
The layers (attention, MLP, the ``eagle2`` / ``eagle3`` specialist styles) are in `modeling_poss_layers`.

The building blocks the drafter and the training objective call, the same for every layer style and feature setting:

- ``fuse_target_features(f)``: target features `[B, T, k*H]` -> `[B, T, H]` (``feature_fc``; identity when the
  draft reads the single post-norm feature);
- ``fuse(x, f)``: tokens `[B, T]` and H-wide features `[B, T, H]` -> fused pairs `[B, T, config.fused_size]`;
- ``position_embeddings(fused, position_ids)``; ``layers[s].project_kv(fused, emb)``; ``layers[s](fused, emb, k, v, mask)``
  -> predicted features `[B, T, H]`;
- ``compute_logits(features)`` -> draft logits `[..., V']`; ``to_target_tokens(ids)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from .configuration_poss import TREE_GENERATION_KEYS, PosSDraftConfig
from .modeling_outputs import PosSDraftOutput
from .modeling_poss_layers import (
    LAYER_CLASSES,
    PosSAttention,
    PosSDecoderLayer,
    PosSEagle3DecoderLayer,
    as_bool_mask,
    causal_mask,
)
from .quantization.int8 import Int8Linear, linear_bias, linear_weight
from .speculation.draft_cache import PosSDraftCache


# ---------------------------------------------------------------------------------------------------- model
class PosSPreTrainedModel(PreTrainedModel):
    config_class = PosSDraftConfig
    base_model_prefix = "poss"
    _no_split_modules = ["PosSDecoderLayer", "PosSEagle3DecoderLayer"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """Recompute each unrolled training step in the backward pass (the objective honours this flag)."""
        object.__setattr__(self, "_poss_checkpoint_layers", True)

    def gradient_checkpointing_disable(self):
        object.__setattr__(self, "_poss_checkpoint_layers", False)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self, "_poss_checkpoint_layers", False))


class PosSDraftModel(PosSPreTrainedModel):
    """PosS draft: the pair [embed(x_{t+1}), f_t] is fused (``fc`` in the ``eagle2`` style, inside the layer in the
    ``eagle3`` style); specialist ``s`` predicts f_{t+1}; logits via the target's lm_head (or the draft's own). The
    target's embedding and lm_head are borrowed with [`attach_target`] and never saved.

    Modules: ``feature_fc`` (k*H -> H, only with ``config.feature_layers``), ``fc`` (2H -> H, ``eagle2`` only),
    ``layers`` (``num_specialists`` specialist layers of ``config.layer_style``), ``norm`` (final norm, ``eagle3``
    only), ``lm_head`` (only with ``config.own_lm_head``), ``embed_tokens`` (only with ``config.own_embeddings``).
    """

    def __init__(self, config: PosSDraftConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.feature_fc = None
        if config.feature_layers is not None:
            self.feature_fc = nn.Linear(config.target_feature_size, hidden, bias=False)
        eagle3 = config.layer_style == "eagle3"
        self.fc = None if eagle3 else nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        layer_class = LAYER_CLASSES[config.layer_style]
        self.layers = nn.ModuleList([layer_class(config) for _ in range(config.num_specialists)])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps) if eagle3 else None
        self.lm_head = None
        if config.own_lm_head:
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size or config.vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if config.own_embeddings else None
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_to_target = None
        self._target_embed = None
        self._target_lm_head = None
        self._draft_head_weight = None
        self.generation_config = GenerationConfig(**{k: getattr(config, k) for k in TREE_GENERATION_KEYS})
        self.model_card_extra: str | None = None  # hand-written part of the model card (kept across saves)
        self.training_recipe: dict | None = None  # saved as training_recipe.json; its "eval" block feeds the card
        self.post_init()

    # ------------------------------------------------------------------ target
    def attach_target(self, target) -> "PosSDraftModel":
        """Borrow ``target``'s input embeddings and lm_head (frozen, not saved). Refuses a target that does not fit."""
        config = getattr(target, "config", None)
        if config is None or not hasattr(target, "get_output_embeddings"):
            raise TypeError(f"attach_target expects a transformers causal LM, got {type(target).__name__}.")
        self.config.check_target(config)
        lm_head = target.get_output_embeddings()
        embed = target.get_input_embeddings()
        if lm_head is None or embed is None:
            raise ValueError("The target has no input embeddings or no lm_head to borrow; use a causal LM.")
        in_features = linear_weight(lm_head).shape[-1]
        if in_features != self.config.hidden_size:
            raise ValueError(
                f"The target's lm_head takes {in_features} features, the draft makes {self.config.hidden_size}."
            )
        object.__setattr__(self, "_target_embed", embed)
        object.__setattr__(self, "_target_lm_head", lm_head)
        object.__setattr__(self, "_draft_head_weight", None)
        return self

    @property
    def is_attached(self) -> bool:
        """Whether the draft has an embedding and an lm_head to run with (its own, or a target's)."""
        has_head = self.lm_head is not None or self._target_lm_head is not None
        return has_head and (self._target_embed is not None or self.embed_tokens is not None)

    def _require_target(self):
        if not self.is_attached:
            raise RuntimeError(
                "This PosS draft has no target attached: call `draft.attach_target(target)` first "
                "(generate() does it for you)."
            )

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Token embeddings: the draft's own copy when it carries one, else the target's."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        self._require_target()
        return self._target_embed(input_ids)

    def _head_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` of the lm_head used for drafting: the draft-vocabulary rows of the target's lm_head,
        gathered once (a quantized head is also unpacked once, not at every draft step)."""
        self._require_target()
        head = self._target_lm_head
        probe = getattr(head, "weight", None)
        key = (probe.device, probe.dtype) if isinstance(probe, torch.Tensor) else None
        cached = self._draft_head_weight
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        weight, bias = linear_weight(head).detach(), linear_bias(head)
        if self.draft_to_target is not None:
            weight = weight[self.draft_to_target.to(weight.device)]
            bias = None if bias is None else bias[self.draft_to_target.to(bias.device)]
        object.__setattr__(self, "_draft_head_weight", (key, weight, bias))
        return weight, bias

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits `[..., V']` of `[..., H]` predicted features (V' = draft vocabulary size when a token map is
        set). The ``eagle3`` style applies its final ``norm`` first; ``own_lm_head`` drafts use their own head."""
        if self.norm is not None:
            features = self.norm(features.to(self.norm.weight.dtype))
        if self.lm_head is not None:
            return self.lm_head(features.to(self._compute_dtype(self.lm_head)))
        return self.target_logits(features)

    def logits_head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(weight [V', H], bias)`` of the linear map that [`compute_logits`] applies after the final ``norm`` (if
        any), for losses that fuse it with the softmax; None when it is not a plain float linear (an int8 head). The
        target's rows come detached (it is frozen); the draft's own ``lm_head`` keeps its gradients."""
        if self.lm_head is not None:
            return self.lm_head.weight, self.lm_head.bias
        return self.target_head()

    def target_head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(weight [V', H], bias)``, detached, of [`target_logits`]'s linear map; None for an int8 or other head."""
        self._require_target()
        if isinstance(self._target_lm_head, Int8Linear):
            return None
        if self.draft_to_target is not None:
            return self._head_weight()
        head = self._target_lm_head
        if not isinstance(head, nn.Linear):
            return None
        return head.weight.detach(), None if head.bias is None else head.bias.detach()

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The TARGET's logits `[..., V']` over the drafting vocabulary of `[..., H]` features: its lm_head (the
        draft-vocabulary rows), never the draft's final ``norm`` or own ``lm_head``. Of the target's post-norm
        features these are the soft labels of training."""
        if self.draft_to_target is None:
            self._require_target()
            head = self._target_lm_head
            return head(features.to(self._compute_dtype(head)))
        if isinstance(self._target_lm_head, Int8Linear):  # an int8 head: its draft-vocabulary rows stay int8
            return self._int8_draft_head()(features)
        weight, bias = self._head_weight()
        return F.linear(features.to(weight.dtype), weight, bias)

    def _int8_draft_head(self) -> Int8Linear:
        """The draft-vocabulary rows of an int8 target head as one `Int8Linear`, built once: a draft step reads a
        quarter of the float rows' bytes (the draft only proposes, so its logits need not be batch-invariant)."""
        head = self._target_lm_head
        cached = self.__dict__.get("_int8_head")
        if cached is None or cached[0] is not head.weight_int8_t:
            rows = head.select_rows(self.draft_to_target)
            rows.per_token = False  # one fbgemm call per step: the draft only proposes
            cached = (head.weight_int8_t, rows)
            self.__dict__["_int8_head"] = cached
        return cached[1]

    def to_target_tokens(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Map draft-vocabulary indices to target token ids (identity without a token map)."""
        if self.draft_to_target is None:
            return draft_ids
        return self.draft_to_target.to(draft_ids.device)[draft_ids]

    # ------------------------------------------------------------------ building blocks
    def fuse_target_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features `[B, T, config.target_feature_size]` -> H-wide features `[B, T, H]`.

        With ``config.feature_layers`` the k selected target hidden states (concatenated in that order) go through
        ``feature_fc``; without, the post-norm feature is returned unchanged. Only target features are fused: the
        draft's own predictions are already H-wide.
        """
        expected = self.config.target_feature_size
        if features.shape[-1] != expected:
            source = (f"the {self.config.num_feature_layers} target hidden states {self.config.feature_layers} "
                      "concatenated" if self.feature_fc is not None else "the target's post-norm hidden state")
            raise ValueError(f"target features of width {features.shape[-1]} given; this draft reads {expected} "
                             f"({source}).")
        if self.feature_fc is None:
            return features
        return self.feature_fc(features.to(self._compute_dtype(self.feature_fc)))

    def fuse(self, input_ids: torch.LongTensor, features: torch.Tensor) -> torch.Tensor:
        """Fused pairs `[B, T, config.fused_size]` of `[B, T]` tokens x_{t+1} and H-wide features `[B, T, H]` (target
        features after [`fuse_target_features`], or the draft's own predictions).

        ``eagle2``: ``fc(cat(embed(x), f))`` `[B, T, H]`; ``eagle3``: ``cat(embed(x), f)`` `[B, T, 2H]` (the layer
        normalises both halves itself).
        """
        if features.shape[-1] != self.config.hidden_size:
            raise ValueError(f"fuse takes H = {self.config.hidden_size} wide features, got {features.shape[-1]}; pass "
                             "target features through draft.fuse_target_features first.")
        dtype = self._layer_dtype()
        pairs = torch.cat([self.embed(input_ids).to(dtype), features.to(dtype)], dim=-1)
        return pairs if self.fc is None else self.fc(pairs)

    def _layer_dtype(self) -> torch.dtype:
        """Input dtype of the fused pairs (that of ``fc``, else of the first layer's projections)."""
        return self._compute_dtype(self.fc if self.fc is not None else self.layers[0].self_attn.q_proj)

    @staticmethod
    def _compute_dtype(linear: nn.Module) -> torch.dtype:
        """Input dtype of a linear layer (float32 for a quantized one)."""
        weight = getattr(linear, "weight", None)
        return weight.dtype if isinstance(weight, torch.Tensor) else torch.float32

    def position_embeddings(self, hidden_states: torch.Tensor, position_ids: torch.LongTensor):
        """RoPE (cos, sin) for `[B, T]` position ids, each `[B, T, head_dim]`."""
        return self.rotary_emb(hidden_states, position_ids)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        specialist: int = 0,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: PosSDraftCache | None = None,
        *,
        loss_mask: torch.Tensor | None = None,
        return_loss: bool = True,
        assistant_mask: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        last_hidden_state: torch.Tensor | None = None,
        **training_inputs,
    ) -> PosSDraftOutput:
        """Run one specialist over context pairs.

        Args:
            input_ids (`[B, T]`): tokens x_{t+1}.
            target_hidden_states (`[B, T, config.target_feature_size]`): target features f_t: post-final-norm
                `[B, T, H]`, or with ``config.feature_layers`` the k selected hidden states concatenated `[B, T, k*H]`.
            specialist (`int`): which specialist layer.
            position_ids (`[B, T]`, *optional*): defaults to ``past .. past + T - 1``.
            attention_mask (*optional*): 2D padding mask over past + T keys, or a 4D bool/additive mask.
            cache ([`PosSDraftCache`], *optional*): keys/values of earlier pairs for this specialist; updated in place.
            loss_mask (`[B, T]`, *optional*): pairs whose prediction is trained; selects the multi-step training
                objective (see ``transformers_poss.training``), as do the other ``training_inputs``.
            return_loss (`bool`): unused; declared so that a plain `Trainer` knows the loss comes back without labels
                (it then reports ``eval_loss``).
            assistant_mask, hidden_states, last_hidden_state: dataset columns that `PosSDataCollator` turns into
                ``loss_mask``, ``target_hidden_states`` and ``target_last_hidden_state`` (multi-layer features);
                declared so that the Trainer's ``remove_unused_columns=True`` keeps them. Passing them here is an
                error.
        """
        if assistant_mask is not None or hidden_states is not None or last_hidden_state is not None:
            raise ValueError(
                "`assistant_mask` / `hidden_states` / `last_hidden_state` are dataset columns, not draft inputs: "
                "collate the examples with transformers_poss.training.PosSDataCollator (it builds loss_mask, "
                "target_hidden_states and target_last_hidden_state)."
            )
        if loss_mask is not None:
            training_inputs["loss_mask"] = loss_mask
        if training_inputs:
            from .training.objective import training_forward

            return training_forward(self, input_ids, target_hidden_states, **training_inputs)
        valid = hasattr(specialist, "__index__") and not isinstance(specialist, bool)  # ints, numpy / 0-d tensor ints
        if not valid or not 0 <= int(specialist) < self.config.num_specialists:
            raise ValueError(f"specialist must be in [0, {self.config.num_specialists}), got {specialist!r}.")
        specialist = int(specialist)
        hidden = self.fuse(input_ids, self.fuse_target_features(target_hidden_states))
        batch, length, _ = hidden.shape
        past = cache.get_seq_length(specialist) if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=hidden.device)[None].expand(batch, -1)
        pos_emb = self.position_embeddings(hidden, position_ids)
        layer = self.layers[specialist]
        keys, values = layer.project_kv(hidden, pos_emb)
        if cache is not None:
            keys, values = cache.update(specialist, keys, values)
        mask = causal_mask(length, past, hidden.device) if attention_mask is None else as_bool_mask(attention_mask, length, past)
        out = layer(hidden, pos_emb, keys, values, mask)
        return PosSDraftOutput(last_hidden_state=out, cache=cache)

    # ------------------------------------------------------------------ drafting
    def draft_tree(self, input_ids, target_hidden_states, depth=None, top_k=None, total_tokens=None):
        """Draft one EAGLE-2 dynamic tree with position specialists from scratch.

        Args:
            input_ids (`[1, n + 1]`): x_0 .. x_n; x_n is the root.
            target_hidden_states (`[1, n, config.target_feature_size]`): f_0 .. f_{n-1}.
        Returns: a [`DraftTree`].
        """
        from .speculation.drafter import PosSProposer

        from .checks import tree_value

        gen = self.generation_config
        depth, top_k, total_tokens = (
            tree_value(name, getattr(gen, name) if value is None else value)
            for name, value in zip(("tree_depth", "tree_top_k", "tree_total_tokens"), (depth, top_k, total_tokens))
        )
        if total_tokens == "auto":
            raise ValueError("draft_tree needs a node count: pass total_tokens=N ('auto' is chosen inside generate).")
        proposer = PosSProposer(self, depth=depth, top_k=top_k, total_tokens=total_tokens)
        return proposer.propose(input_ids[:, 1:], target_hidden_states)

    # ------------------------------------------------------------------ hub (transformers_poss.checkpoints)
    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained`` plus ``generation_config.json`` (tree shape), the draft's model card
        (``tags=`` adds card tags) and ``training_recipe.json`` when set; ``push_to_hub=True`` uploads them too."""
        from .checkpoints import save_pretrained_with_card

        return save_pretrained_with_card(self, super().save_pretrained, save_directory, args, kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the draft (safetensors, config, generation config with the tree shape, its model card and
        training recipe) in one commit; ``tags=`` adds card tags. Returns the `CommitInfo`."""
        from .checkpoints import push_draft_to_hub

        return push_draft_to_hub(self, repo_id, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained`` with the checks of a draft folder around it (a target, an authors'
        checkpoint or a broken save is refused, naming the folder), reading back the tree shape, card and recipe."""
        from .checkpoints import load_pretrained

        return load_pretrained(super().from_pretrained, pretrained_model_name_or_path, args, kwargs)

    @classmethod
    def from_official(cls, repo_id_or_folder, target=None, positions_per_specialist=None, dtype=None, **hub_kwargs):
        """Load a checkpoint released with the PosS paper, an EAGLE / HASS one, or an EAGLE-3 one (as an
        ``eagle3``-style draft reading its aux target layers); ``target`` is attached. The checkpoint is read by
        [`transformers_poss.checkpoints.read_official`]; the draft is in ``dtype`` (default: the target's, else
        float32) and in eval mode."""
        from .checkpoints import read_official

        checkpoint = read_official(repo_id_or_folder, target=target, positions_per_specialist=positions_per_specialist,
                                   **hub_kwargs)
        model = cls(checkpoint.config)
        missing, unexpected = model.load_state_dict(checkpoint.state_dict, strict=False)
        missing = [k for k in missing if k != "draft_to_target"]
        if missing or unexpected:
            raise ValueError(f"Checkpoint does not fit the draft architecture: missing {missing}, unexpected "
                             f"{unexpected}.")
        if checkpoint.token_map is not None:
            model.draft_to_target.copy_(checkpoint.token_map)
        for key, value in checkpoint.generation.items():  # the tree shape an exported checkpoint recorded
            setattr(model.generation_config, key, value)
        if getattr(model.generation_config, "tree_context_candidates", None) is None:
            model.generation_config.tree_context_candidates = False  # the paper's trees: the draft's nodes only
        model = model.to(dtype or (target.dtype if target is not None else torch.float32)).eval()
        if target is not None:
            model.to(target.get_output_embeddings().weight.device).attach_target(target)
        return model


__all__ = [
    "PosSDraftModel", "PosSDraftOutput", "PosSDraftCache", "PosSDecoderLayer", "PosSEagle3DecoderLayer", "PosSAttention",
    "causal_mask", "as_bool_mask",
]
