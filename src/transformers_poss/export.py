"""Deprecated import path, kept for one release: `transformers_poss.export` is now
`transformers_poss.checkpoints.export` (the same objects, re-exported). Import from the new place.
"""

from .checkpoints.export import *  # noqa: F401,F403
from .checkpoints.export import __all__  # noqa: F401
