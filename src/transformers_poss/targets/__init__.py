"""Real targets that ship with the package (GGUF files on PyPI) and any Hub id / folder: `embedded.load_target`."""

from .embedded import load_target, uses_chat_template

__all__ = ["load_target", "uses_chat_template"]
