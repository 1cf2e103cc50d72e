"""``transformers_poss.embedded``: the name the public API gives `transformers_poss.targets.embedded`.

This module is replaced by that one on import, so both names are the same module object (attributes set on one,
e.g. by tests, are seen through the other).
"""

import sys

from .targets import embedded as _embedded

sys.modules[__name__] = _embedded
