"""Deprecated import path, kept for one release: the EAGLE-3 import is now part of
`transformers_poss.checkpoints.official` (the same objects, re-exported). Import from the new place.
"""

from .checkpoints.official import (aux_layer_ids, check_eagle3_layout, eagle3_settings, eagle3_state,  # noqa: F401
                                   is_eagle3_checkpoint, token_map)

__all__ = ["aux_layer_ids", "check_eagle3_layout", "eagle3_settings", "eagle3_state", "is_eagle3_checkpoint",
           "token_map"]
