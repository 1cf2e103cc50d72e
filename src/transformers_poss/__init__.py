"""PosS (Position Specialists) tree speculative decoding for Hugging Face transformers."""

__version__ = "0.1.0"
