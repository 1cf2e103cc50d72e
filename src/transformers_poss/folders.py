"""Deprecated import path, kept for one release: `transformers_poss.folders` is now
`transformers_poss.checkpoints.folders` (the same objects, re-exported). Import from the new place.
"""

from .checkpoints.folders import *  # noqa: F401,F403
from .checkpoints.folders import __all__  # noqa: F401
