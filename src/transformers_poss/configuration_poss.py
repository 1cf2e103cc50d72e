"""Configuration of PosS draft models."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

# the default draft-tree shape (the paper's): depth / top-k / nodes verified per round, root included. Written once
# here; the model's generation_config, the model card and the generation loops read it from here.
DEFAULT_TREE_SHAPE = {"tree_depth": 6, "tree_top_k": 10, "tree_total_tokens": 60}
TREE_GENERATION_KEYS = tuple(DEFAULT_TREE_SHAPE)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return value


def _activation(name: Any) -> str:
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"`hidden_act` {name!r} is not an activation transformers knows; use one of "
                         f"{', '.join(sorted(ACT2FN))} (PosS drafts use 'silu').")
    return name


def _rope(rope: dict) -> dict:
    """Check RoPE settings: a known ``rope_type`` and a positive finite ``rope_theta``."""
    import math

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = rope.get("rope_type")
    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"`rope_type` {kind!r} is unknown; use 'default' or one of {', '.join(ROPE_INIT_FUNCTIONS)}"
                         " (copy the target's rope_parameters).")
    theta = rope.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"`rope_theta` must be a positive number, got {theta!r} (copy the target's rope_theta).")
    return rope


LAYER_STYLES = ("eagle2", "eagle3")


def eagle3_feature_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default target layers ``[2, L // 2, L - 3]`` for a target of ``num_hidden_layers`` (L) layers, as
    indices into its ``hidden_states`` tuple (the inputs of decoder layers 2, L // 2 and L - 3)."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def _feature_layers(value: Any, num_hidden_layers: int | None) -> list[int] | None:
    """Check ``feature_layers``: None, or distinct ints in ``[0, num_hidden_layers]`` (upper bound when known)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"`feature_layers` must be a list of target layer indices, got {value!r}.")
    layers = list(value)
    if not layers or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        raise ValueError(f"`feature_layers` must be a non-empty list of integers, got {value!r}.")
    if len(set(layers)) != len(layers):
        raise ValueError(f"`feature_layers` {layers} repeats a layer; give each target layer once.")
    top = "num_hidden_layers" if num_hidden_layers is None else num_hidden_layers
    if min(layers) < 0 or (num_hidden_layers is not None and max(layers) > num_hidden_layers):
        raise ValueError(
            f"`feature_layers` {layers} must lie in [0, {top}]: indices into the target's hidden_states (0 = the "
            f"embedding output, i = the output of decoder layer i - 1, {top} = the post-final-norm state); negative "
            "indices are not accepted."
        )
    return layers


# the names causal LM configs give their sizes (transformers' `attribute_map` covers most; these cover the rest)
_HIDDEN_NAMES = ("hidden_size", "n_embd", "d_model", "dim", "model_dim", "embed_dim", "hidden_dim")
_HEAD_NAMES = ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads")
_KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads", "num_key_value_groups_total")
_LAYER_NAMES = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
_FFN_NAMES = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
              "inner_hidden_size", "mlp_dim", "dim_ff")
_EPS_NAMES = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps", "rms_norm_epsilon")
# recurrent / state-space architectures: no attention over a cache for a tree mask (some name SSM "heads")
RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
_POSITION_NAMES = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")


def _size(config, *names):
    """The first of ``names`` that ``config`` gives (through its ``attribute_map`` too); per-layer values that a
    config refuses to give globally count as absent."""
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # e.g. transformers' per-layer attributes, which have no single value
            continue
        if value is not None and not isinstance(value, bool):
            return value
    return None


def _intermediate(config, hidden: int) -> int:
    """The target's MLP width (the largest of a per-layer list; 4 * hidden when the config names none)."""
    value = _size(config, *_FFN_NAMES)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        value = max(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value > 0 else 4 * hidden


class PosSDraftConfig(PreTrainedConfig):
    r"""Configuration of a [`PosSDraftModel`]: an EAGLE-style feature draft with position-specialist layers.

    The draft fuses the target's embedding of token ``x_{t+1}`` with the target's feature ``f_t`` and runs one of
    ``num_specialists`` Llama-style decoder layers over it. Draft step ``j`` (``j = 0`` produces depth 1) uses
    specialist ``min(j // positions_per_specialist, num_specialists - 1)``. EAGLE-2 and HASS drafts are the case
    ``num_specialists = 1``.

    Target features. ``feature_layers=None`` (default): ``f_t`` is the target's post-final-norm hidden state (the
    lm_head input), `[.., H]`. ``feature_layers=[i_1, .., i_k]`` (EAGLE-3 style): ``f_t`` is the concatenation, in
    that order, of ``hidden_states[i_1], .., hidden_states[i_k]`` of the target's transformers ``hidden_states``
    tuple (``output_hidden_states``), `[.., k * H]` (``target_feature_size``), where index 0 is the embedding
    output, index i the output of decoder layer i - 1 (= the input of decoder layer i) and index
    ``num_hidden_layers`` the post-final-norm state. ``feature_fc`` (k*H -> H, no bias) fuses them into one H-wide
    feature; only target features are fused, later draft steps feed the draft's own H-wide predictions. EAGLE-3's
    aux layers are this convention: the EAGLE repository's Llama forward (and vLLM's
    ``eagle_aux_hidden_state_layer_ids``, SpecForge) records the hidden state entering decoder layer ``idx`` for
    ``idx in (2, L // 2, L - 3)``, before that layer runs, i.e. ``hidden_states[idx]``; so EAGLE-3's default is
    ``feature_layers=[2, L // 2, L - 3]`` ([`eagle3_feature_layers`]), aux ids carry over unchanged.

    Layer styles. ``layer_style="eagle2"`` (default): ``fc(cat(embed(x), f))`` 2H -> H, then a decoder layer with
    ``post_attention_layernorm`` but no input norm and no final norm. ``layer_style="eagle3"``: EAGLE-3's midlayer
    (``input_layernorm`` on the embedding, ``hidden_norm`` on the feature, q/k/v over their 2H concatenation, the
    feature as residual, ``post_attention_layernorm`` + MLP) and a final ``norm`` before the lm_head; no ``fc``.

    Args:
        vocab_size (`int`): vocabulary of the target (size of its lm_head).
        hidden_size (`int`): the target's hidden size (feature size).
        intermediate_size (`int`): MLP width of every specialist layer.
        num_attention_heads (`int`), num_key_value_heads (`int`), head_dim (`int`, *optional*): attention shape.
        rms_norm_eps (`float`): epsilon of the post-attention RMSNorm.
        rope_parameters (`dict`, *optional*): RoPE settings as in transformers (``rope_type``, ``rope_theta``, ...).
        max_position_embeddings (`int`): longest sequence the draft (and its target) handle.
        num_specialists (`int`): S, the number of specialist decoder layers.
        positions_per_specialist (`int`): N, consecutive draft positions each specialist handles (PosS-N).
        fc_bias (`bool`): whether the fusion layer has a bias.
        tree_depth / tree_top_k / tree_total_tokens (`int`): default draft-tree shape (copied to the model's
            ``generation_config``).
        draft_vocab_size (`int`, *optional*): size of a reduced drafting vocabulary (a token map is then stored in
            the checkpoint); None drafts over the full vocabulary.
        own_embeddings (`bool`): the draft carries its own token embedding (saved) instead of borrowing the target's.
        feature_layers (`list[int]`, *optional*): the target hidden states the draft reads (see above); None = the
            single post-final-norm feature.
        layer_style (`str`): ``"eagle2"`` or ``"eagle3"`` (see above).
        own_lm_head (`bool`): the draft carries its own lm_head `[draft_vocab_size or vocab_size, H]` (saved, as
            EAGLE-3 checkpoints do) instead of borrowing the target's lm_head rows.
        target_num_hidden_layers (`int`, *optional*): the target's decoder layer count (fingerprint; bounds
            ``feature_layers``).
        target_model_type / target_name_or_path / target_vocab_size / target_hidden_size: fingerprint of the target
            the draft was made for; checked when the draft is attached.
    """

    model_type = "poss_draft"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        intermediate_size: int = 14336,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 8192,
        num_specialists: int = 1,
        positions_per_specialist: int = 1,
        fc_bias: bool = True,
        initializer_range: float = 0.02,
        tree_depth: int = DEFAULT_TREE_SHAPE["tree_depth"],
        tree_top_k: int = DEFAULT_TREE_SHAPE["tree_top_k"],
        tree_total_tokens: int = DEFAULT_TREE_SHAPE["tree_total_tokens"],
        draft_vocab_size: int | None = None,
        own_embeddings: bool = False,
        target_model_type: str | None = None,
        target_name_or_path: str | None = None,
        target_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        training_depth: int | None = None,
        feature_layers: list[int] | None = None,
        layer_style: str = "eagle2",
        own_lm_head: bool = False,
        target_num_hidden_layers: int | None = None,
        **kwargs,
    ):
        self.vocab_size = _positive_int("vocab_size", vocab_size)
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.intermediate_size = _positive_int("intermediate_size", intermediate_size)
        self.num_attention_heads = _positive_int("num_attention_heads", num_attention_heads)
        self.num_key_value_heads = _positive_int(
            "num_key_value_heads", num_attention_heads if num_key_value_heads is None else num_key_value_heads
        )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_attention_heads` ({num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        if head_dim is None:
            if hidden_size % num_attention_heads:
                raise ValueError(
                    f"`hidden_size` ({hidden_size}) is not divisible by `num_attention_heads` ({num_attention_heads});"
                    " pass `head_dim` explicitly."
                )
            head_dim = hidden_size // num_attention_heads
        self.head_dim = _positive_int("head_dim", head_dim)
        self.hidden_act = _activation(hidden_act)
        if rms_norm_eps <= 0:
            raise ValueError(f"`rms_norm_eps` must be > 0, got {rms_norm_eps}.")
        self.rms_norm_eps = float(rms_norm_eps)
        rope = dict(rope_parameters or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", float(kwargs.pop("rope_theta", 10000.0)))
        self.rope_parameters = _rope(rope)
        self.max_position_embeddings = _positive_int("max_position_embeddings", max_position_embeddings)
        self.num_specialists = _positive_int("num_specialists", num_specialists)
        self.positions_per_specialist = _positive_int("positions_per_specialist", positions_per_specialist)
        derived = self.num_specialists * self.positions_per_specialist
        if training_depth is not None and training_depth != derived:
            raise ValueError(
                f"`training_depth` is derived as num_specialists * positions_per_specialist = {derived}; got "
                f"{training_depth}. Leave it unset."
            )
        self.fc_bias = bool(fc_bias)
        self.initializer_range = initializer_range
        self.tree_depth = _positive_int("tree_depth", tree_depth)
        self.tree_top_k = _positive_int("tree_top_k", tree_top_k)
        self.tree_total_tokens = _positive_int("tree_total_tokens", tree_total_tokens)
        if self.tree_total_tokens < 2:
            raise ValueError("`tree_total_tokens` counts the root too and must be at least 2.")
        if draft_vocab_size is not None:
            _positive_int("draft_vocab_size", draft_vocab_size)
            if draft_vocab_size > self.vocab_size:
                raise ValueError(f"`draft_vocab_size` ({draft_vocab_size}) exceeds `vocab_size` ({self.vocab_size}).")
        self.draft_vocab_size = draft_vocab_size
        self.own_embeddings = bool(own_embeddings)
        self.target_model_type = target_model_type
        self.target_name_or_path = target_name_or_path
        self.target_vocab_size = target_vocab_size
        self.target_hidden_size = target_hidden_size
        if target_num_hidden_layers is not None:
            _positive_int("target_num_hidden_layers", target_num_hidden_layers)
        self.target_num_hidden_layers = target_num_hidden_layers
        self.feature_layers = _feature_layers(feature_layers, target_num_hidden_layers)
        if layer_style not in LAYER_STYLES:
            raise ValueError(f"`layer_style` must be one of {', '.join(LAYER_STYLES)}, got {layer_style!r}.")
        self.layer_style = layer_style
        self.own_lm_head = bool(own_lm_head)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    # ------------------------------------------------------------------ derived values
    @property
    def training_depth(self) -> int:
        """K = num_specialists * positions_per_specialist: the draft depth the specialists were trained for."""
        return self.num_specialists * self.positions_per_specialist

    def specialist_for_step(self, step: int) -> int:
        """Specialist used by draft step ``step`` (step 0 yields depth 1): ``min(step // N, S - 1)``."""
        return min(step // self.positions_per_specialist, self.num_specialists - 1)

    @property
    def num_feature_layers(self) -> int:
        """k: target hidden states concatenated per position (1 without ``feature_layers``)."""
        return 1 if self.feature_layers is None else len(self.feature_layers)

    @property
    def target_feature_size(self) -> int:
        """Width of the target features the draft reads: ``k * hidden_size`` with ``feature_layers``, else H."""
        return self.num_feature_layers * self.hidden_size

    @property
    def fused_size(self) -> int:
        """Width of a fused pair fed to a specialist layer: H (``eagle2``: after ``fc``) or 2H (``eagle3``: the
        embedding and the feature side by side, normalised inside the layer)."""
        return 2 * self.hidden_size if self.layer_style == "eagle3" else self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["training_depth"] = self.training_depth
        return out

    # ------------------------------------------------------------------ target fingerprint
    @classmethod
    def for_target(
        cls,
        target_config,
        num_specialists: int = 1,
        positions_per_specialist: int = 1,
        intermediate_size: int | None = None,
        fc_bias: bool = True,
        name_or_path: str | None = None,
        **kwargs,
    ) -> "PosSDraftConfig":
        """A draft config whose layer shape, vocabulary, RoPE and fingerprint come from ``target_config``.

        ``target_config`` is the target's ``config`` (its text config is used for multimodal models). Other keyword
        arguments are config fields, e.g. ``feature_layers=[2, L // 2, L - 3]`` (checked against the target's
        ``num_hidden_layers``), ``layer_style="eagle3"``, ``own_lm_head=True``.
        """
        text = target_config.get_text_config(decoder=True) if hasattr(target_config, "get_text_config") else target_config
        rope = _size(text, "rope_parameters")
        if isinstance(rope, dict) and "full_attention" in rope:  # per-layer-type rope (Gemma 3)
            rope = rope["full_attention"]
        if not isinstance(rope, dict) or not rope:
            rope = {"rope_type": "default", "rope_theta": _size(text, "rope_theta") or 10000.0}
        hidden = _size(text, *_HIDDEN_NAMES)
        num_heads = _size(text, *_HEAD_NAMES)
        if getattr(text, "model_type", None) in RECURRENT_MODEL_TYPES:
            num_heads = None
        if not isinstance(hidden, int) or not isinstance(num_heads, int):
            kind = getattr(text, "model_type", type(text).__name__)
            raise ValueError(
                f"for_target: the {kind!r} config names no {'hidden size' if not isinstance(hidden, int) else ''}"
                f"{' and no ' if not isinstance(hidden, int) and not isinstance(num_heads, int) else ''}"
                f"{'attention head count' if not isinstance(num_heads, int) else ''} (a recurrent or state-space "
                "model has none; some configs only give them per layer): tree verification needs an attention "
                "target. Pass the sizes to PosSDraftConfig yourself if this target has attention layers."
            )
        head_dim, positions = _size(text, "head_dim"), _size(text, *_POSITION_NAMES)
        return cls(
            vocab_size=text.vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate_size or _intermediate(text, hidden),
            num_attention_heads=num_heads,
            num_key_value_heads=_size(text, *_KV_HEAD_NAMES) or num_heads,
            head_dim=head_dim if isinstance(head_dim, int) else hidden // num_heads,
            rms_norm_eps=_size(text, *_EPS_NAMES) or 1e-6,
            rope_parameters=dict(rope),
            max_position_embeddings=positions if isinstance(positions, int) and positions > 0 else 8192,
            num_specialists=num_specialists,
            positions_per_specialist=positions_per_specialist,
            fc_bias=fc_bias,
            target_model_type=text.model_type,
            target_name_or_path=name_or_path or getattr(target_config, "_name_or_path", None) or None,
            target_vocab_size=text.vocab_size,
            target_hidden_size=hidden,
            target_num_hidden_layers=_size(text, *_LAYER_NAMES),
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
            **kwargs,
        )

    def check_target(self, target_config) -> None:
        """Raise a ValueError if ``target_config`` does not fit this draft (vocabulary, hidden size, model type)."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        problems = []
        if text.hidden_size != self.hidden_size:
            problems.append(f"hidden size {text.hidden_size} != draft's {self.hidden_size}")
        target_vocab = text.vocab_size
        if target_vocab != self.vocab_size:
            problems.append(f"vocab size {target_vocab} != draft's {self.vocab_size}")
        if self.target_model_type and text.model_type != self.target_model_type:
            problems.append(f"model type {text.model_type!r} != {self.target_model_type!r} the draft was made for")
        layers = getattr(text, "num_hidden_layers", None)
        if self.feature_layers is not None and isinstance(layers, int):
            beyond = [i for i in self.feature_layers if i > layers]
            if beyond:
                problems.append(f"feature layer(s) {beyond} beyond the target's {layers} layers (its hidden_states "
                                f"indices are 0..{layers})")
            elif self.target_num_hidden_layers is not None and layers != self.target_num_hidden_layers:
                problems.append(f"{layers} decoder layers != the {self.target_num_hidden_layers} the draft's "
                                f"feature_layers {self.feature_layers} refer to")
        if problems:
            made_for = self.target_name_or_path or self.target_model_type or "another model"
            raise ValueError(
                f"This PosS draft was made for {made_for} and does not fit this target: " + "; ".join(problems)
                + ". Use a draft built for this target (PosSDraftConfig.for_target(target.config, ...))."
            )
