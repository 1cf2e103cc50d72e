"""``transformers_poss.embedded``: the embedded real targets under the short name the public API gives them
(``from transformers_poss.embedded import load_target``). A plain re-export of `transformers_poss.targets.embedded`;
to patch the module's internals (tests), patch `transformers_poss.targets.embedded` itself.
"""

from .targets.embedded import *  # noqa: F401,F403
from .targets.embedded import __all__, resolve_target, uses_chat_template  # noqa: F401
