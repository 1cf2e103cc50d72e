"""Deprecated import path, kept for one release: `transformers_poss.export_eagle3` is now
`transformers_poss.checkpoints.export_eagle3` (the same objects, re-exported). Import from the new place.
"""

from .checkpoints.export_eagle3 import *  # noqa: F401,F403
from .checkpoints.export_eagle3 import __all__  # noqa: F401
