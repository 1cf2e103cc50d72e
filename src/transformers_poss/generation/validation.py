"""Clear errors for generation settings and inputs that tree speculation cannot honour.

Checked before ``generate`` prepares anything (settings) and once it has prepared the inputs, so that nothing is
ever silently wrong: an unsupported mode, cache, attention implementation, quantization or draft is refused with a
message that says what to change.
"""

from __future__ import annotations

import warnings

import torch
from transformers.generation.configuration_utils import GenerationMode

from .._transformers_compat import attn_implementation
from ..configuration_poss import RECURRENT_MODEL_TYPES
from ..quantization.exact_attention import EXACT_ATTENTION
from ..quantization.int8 import has_int8_activations, is_batch_variant
from ..speculation.target_cache import UnsupportedCacheError, check_cache_supported

SUPPORTED_ATTENTION = ("sdpa", "eager", EXACT_ATTENTION)


# targets whose positions are not read from position_ids (ALiBi biases built from the 2D mask) and targets without
# attention over a cache (recurrent / state-space): a tree forward cannot be expressed for them
_ALIBI_MODEL_TYPES = ("bloom", "mpt")


def unsupported_architecture(config) -> str | None:
    """Why tree verification cannot serve a target with ``config`` (None when it can, as far as the config says)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", type(text).__name__)
    if kind in RECURRENT_MODEL_TYPES:
        return (f"the {kind!r} architecture is a recurrent / state-space model: tree verification needs attention "
                "over a cache that takes a 4D tree mask.")
    if kind in _ALIBI_MODEL_TYPES or getattr(text, "alibi", False) is True or (
            getattr(getattr(text, "attn_config", None), "alibi", False) is True):
        return (f"the {kind!r} target uses ALiBi position biases (alibi), which it builds from the 2D attention mask "
                "instead of position ids, so tree nodes would see wrong distances; only rotary and learned "
                "absolute positions are supported.")
    embedding = getattr(text, "position_embedding_type", None)
    if isinstance(embedding, str) and embedding not in ("absolute", "rope", "rotary"):
        return (f"the {kind!r} target uses position_embedding_type={embedding!r}; only rotary and learned absolute "
                "positions are supported.")
    return None


def check_generation_config(model, draft, generation_mode, generation_config) -> None:
    """Clear errors for settings tree speculation cannot honour (called before any preparation)."""
    problem = unsupported_architecture(model.config)
    if problem is not None:
        raise ValueError(f"Tree speculation cannot serve this target: {problem} Generate without assistant_model.")
    if generation_mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"A PosS draft supports greedy decoding and sampling only, but these settings select {generation_mode} "
            f"(num_beams={generation_config.num_beams}). Use num_beams=1 or drop assistant_model."
        )
    if getattr(generation_config, "guidance_scale", None) not in (None, 1, 1.0):
        raise ValueError(
            f"guidance_scale={generation_config.guidance_scale} (classifier-free guidance) runs a second, unconditional "
            "batch beside the prompts, which tree verification cannot carry. Drop guidance_scale or assistant_model."
        )
    if generation_config.num_return_sequences not in (None, 1):
        raise ValueError(
            f"num_return_sequences must be 1 with a PosS draft, got {generation_config.num_return_sequences}."
        )
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if getattr(generation_config, name, None) is not None:
            raise ValueError(f"`{name}` cannot be combined with a PosS draft (assistant_model).")
    if getattr(generation_config, "use_mtp", False):
        raise ValueError("`use_mtp` cannot be combined with a PosS draft (assistant_model).")
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise UnsupportedCacheError(
            f"Tree speculative decoding needs the default dynamic cache on the target; cache_implementation="
            f"{generation_config.cache_implementation!r} (static, quantized or offloaded caches) is not supported."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("output_attentions / output_hidden_states are not supported with a PosS draft.")
    attention = attn_implementation(model.config)
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"Tree verification needs an arbitrary 4D attention mask, which attn_implementation={attention!r} "
            f"cannot take. Load the target with attn_implementation='sdpa' (or 'eager')."
        )
    if is_batch_variant(model):
        raise ValueError(
            "The target holds torch.ao dynamically quantized int8 linears: their activation scale is shared by all "
            "tokens of a forward, so verifying several tokens at once cannot reproduce the target's own greedy output "
            "and tree speculation would not be lossless. Quantize with `transformers_poss.quantize_int8(target)` "
            "(per-token scales and exact attention) or use the float target; quantizing only the draft is fine."
        )
    if has_int8_activations(model) and attention != EXACT_ATTENTION:
        raise ValueError(
            f"The target has int8 activations but attn_implementation={attention!r}: float attention kernels change "
            "their rounding with the number of verified tokens and int8 rounding magnifies it, so speculation would "
            "not be lossless. Call `transformers_poss.use_exact_attention(target)` "
            "(`quantize_int8` does it by default)."
        )
    check_materialized(model, draft)
    warn_near_ties(model, generation_config)
    draft.config.check_target(model.config)  # raises ValueError on fingerprint / vocab / hidden size mismatch
    if getattr(draft, "_target_lm_head", None) is not model.get_output_embeddings():
        try:
            draft.attach_target(model)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"The PosS draft could not be attached to the target: {error}") from error


def check_inputs(model, input_ids, generation_config, model_kwargs, synced_gpus) -> None:
    """Clear errors for inputs tree speculation cannot honour (called once ``generate`` prepared them)."""
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0 or model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("Tree speculative decoding needs `input_ids` (prompts given as inputs_embeds are unsupported).")
    if model.config.is_encoder_decoder:
        raise ValueError("Tree speculative decoding supports decoder-only targets only.")
    if synced_gpus:
        raise ValueError("synced_gpus is not supported with a PosS draft.")
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and generation_config.max_length > max_positions:
        raise ValueError(
            f"The prompt ({input_ids.shape[1]} tokens) plus the tokens to generate reach max_length="
            f"{generation_config.max_length}, beyond the target's max_position_embeddings={max_positions}."
        )
    cache = model_kwargs.get("cache")
    check_cache_supported(cache)
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("Tree speculative decoding cannot continue from a pre-filled cache; pass a fresh one.")


def check_materialized(model, draft) -> None:
    """Refuse a target or draft whose weights are on the meta device (created empty, never loaded). Weights offloaded
    by accelerate (``device_map`` with disk / CPU offload) are on "meta" too but are loaded by hooks: those pass."""
    for name, module in (("target", model), ("PosS draft", draft)):
        if getattr(module, "hf_device_map", None) or any(hasattr(m, "_hf_hook") for m in module.modules()):
            continue
        if any(p.device.type == "meta" for p in module.parameters()):
            raise ValueError(
                f"The {name} has weights on the meta device (an empty model, e.g. from init_empty_weights or "
                "device_map='meta'): load it with real weights before generating."
            )


NEAR_TIE_DTYPES = (torch.bfloat16, torch.float16)
_warned_near_ties: set = set()


def is_bit_exact(model) -> bool:
    """Whether greedy tree speculation reproduces plain greedy ``generate`` bit for bit on this target: float32
    weights, or the int8 exact path (`quantize_int8`: int8 activations with float64 attention). In bfloat16 /
    float16, verifying several tokens in one forward rounds differently from one token at a time, so outputs are
    identical only up to floating-point near-ties."""
    if has_int8_activations(model) and attn_implementation(model.config) == EXACT_ATTENTION:
        return True
    return getattr(model, "dtype", torch.float32) not in NEAR_TIE_DTYPES


def warn_near_ties(model, generation_config) -> None:
    """Warn once per dtype when greedy output can differ from plain ``generate`` at floating-point near-ties."""
    if generation_config.do_sample or is_bit_exact(model):
        return
    dtype = str(model.dtype).replace("torch.", "")
    if dtype in _warned_near_ties:
        return
    _warned_near_ties.add(dtype)
    warnings.warn(
        f"Greedy tree speculation on a {dtype} target matches plain generate only up to floating-point near-ties "
        "(verifying several tokens per forward rounds differently; outputs can diverge where two tokens tie). For "
        "bit-exact output use a float32 target or transformers_poss.quantize_int8 on the CPU.",
        UserWarning,
        stacklevel=2,
    )
