"""Deprecated import path, kept for one release: `transformers_poss.official` is now
`transformers_poss.checkpoints.official` (the same objects, re-exported). Import from the new place.
"""

from .checkpoints.official import *  # noqa: F401,F403
from .checkpoints.official import __all__  # noqa: F401
