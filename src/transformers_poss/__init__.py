"""PosS (Position Specialists) tree speculative decoding for Hugging Face transformers.

Importing the package registers the Auto classes (``AutoConfig`` / ``AutoModel`` for ``model_type="poss_draft"``)
and makes ``generate(assistant_model=draft)`` run tree speculation when ``draft`` is a [`PosSDraftModel`].
"""

from transformers import AutoConfig, AutoModel

from . import _transformers_compat  # noqa: F401  (checks transformers' private internals first; one clear error)
from .configuration_poss import PosSDraftConfig
from .modeling_outputs import PosSDraftOutput
from .modeling_poss import PosSDraftModel
from .quantization import Int8Linear, quantize_int8, register_exact_attention, use_exact_attention
from .speculation.draft_cache import PosSDraftCache
from .speculation.drafter import PosSProposer
from .speculation.tree import DraftTree

__version__ = "0.1.0"

AutoConfig.register(PosSDraftConfig.model_type, PosSDraftConfig, exist_ok=True)
AutoModel.register(PosSDraftConfig, PosSDraftModel, exist_ok=True)
register_exact_attention()  # attn_implementation="poss_exact"

from .generation import enable_tree_generation  # noqa: E402

enable_tree_generation()  # generate(assistant_model=<PosS draft>) runs tree speculation

__all__ = [
    "PosSDraftConfig", "PosSDraftModel", "PosSDraftOutput", "PosSDraftCache", "PosSProposer", "DraftTree",
    "Int8Linear", "quantize_int8", "use_exact_attention",
]
