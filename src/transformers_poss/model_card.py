"""Deprecated import path, kept for one release: `transformers_poss.model_card` is now
`transformers_poss.checkpoints.model_card` (the same objects, re-exported). Import from the new place.
"""

from .checkpoints.model_card import *  # noqa: F401,F403
from .checkpoints.model_card import __all__  # noqa: F401
