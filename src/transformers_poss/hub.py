"""Deprecated import path, kept for one release: `transformers_poss.hub` is now
`transformers_poss.checkpoints.hub` (the same objects, re-exported). Import from the new place.
"""

from .checkpoints.hub import *  # noqa: F401,F403
from .checkpoints.hub import __all__  # noqa: F401
