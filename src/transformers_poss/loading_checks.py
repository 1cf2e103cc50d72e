"""Deprecated import path, kept for one release: `transformers_poss.loading_checks` is now
`transformers_poss.checkpoints.loading` (the same objects, re-exported). Import from the new place.
"""

from .checkpoints.loading import *  # noqa: F401,F403
from .checkpoints.loading import __all__  # noqa: F401
