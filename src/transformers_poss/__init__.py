"""PosS (Position Specialists) tree speculative decoding for Hugging Face transformers.

Importing the package registers the Auto classes (``AutoConfig`` / ``AutoModel`` for ``model_type="poss_draft"``)
and makes ``generate(assistant_model=draft)`` run tree speculation when ``draft`` is a [`PosSDraftModel`].
"""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    # OpenMP threads that sleep instead of spinning between the many small operations of a draft step: several
    # times faster on CPUs shared with other work (set before torch is imported; a user setting wins).
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from transformers import AutoConfig, AutoModel  # noqa: E402

from .configuration_poss import PosSDraftConfig
from .exact_attention import register_exact_attention, use_exact_attention
from .modeling_poss import PosSDraftCache, PosSDraftModel, PosSDraftOutput
from .proposer import PosSProposer
from .quantize import Int8Linear, quantize_int8
from .tree import DraftTree

__version__ = "0.1.0"

AutoConfig.register(PosSDraftConfig.model_type, PosSDraftConfig, exist_ok=True)
AutoModel.register(PosSDraftConfig, PosSDraftModel, exist_ok=True)
register_exact_attention()  # attn_implementation="poss_exact"

try:  # the generation hook lives in its own module
    from .generation import install_generation_hook as _install_generation_hook
except ImportError:  # pragma: no cover - only while the module is absent
    _install_generation_hook = None
else:
    _install_generation_hook()

__all__ = [
    "PosSDraftConfig", "PosSDraftModel", "PosSDraftOutput", "PosSDraftCache", "PosSProposer", "DraftTree",
    "Int8Linear", "quantize_int8", "use_exact_attention",
]
