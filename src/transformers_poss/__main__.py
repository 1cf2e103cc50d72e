"""``python -m transformers_poss COMMAND``: the same as the ``poss`` command."""

from .cli import main

raise SystemExit(main())
