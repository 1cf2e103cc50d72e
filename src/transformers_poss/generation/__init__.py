"""Tree speculative decoding inside transformers' ``generate``.

- `hook`: ``target.generate(assistant_model=draft)`` runs tree speculation for a PosS draft (installed on import).
- `custom_generate`: the same loop as a ``generate(custom_generate=...)`` callable.
- `loop` (B = 1, with the automatic `budget` and the `handover` to transformers' own loop) and `batched` (B > 1): the
  generation loops over the shared speculation core (`transformers_poss.speculation`).
- `candidate_generator`, `target_forward`, `emission`, `validation`, `outputs`: the pieces the loops share.
"""

from .candidate_generator import PosSCandidateGenerator, is_tree_draft, tree_draft_of, tree_shape
from .custom_generate import generate
from .hook import disable_tree_generation, enable_tree_generation, is_tree_generation_enabled
from .loop import tree_assisted_decoding
from .outputs import PosSGenerateOutput

__all__ = [
    "PosSCandidateGenerator", "PosSGenerateOutput", "disable_tree_generation", "enable_tree_generation", "generate",
    "is_tree_draft", "is_tree_generation_enabled", "tree_assisted_decoding", "tree_draft_of", "tree_shape",
]
