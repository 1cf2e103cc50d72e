"""Small checks of user-given values, shared by the library and the command line.

Each function either returns the value in its canonical form or raises a ``ValueError`` (or ``FileNotFoundError``)
whose message names the setting and says what to give instead. Nothing here falls back to a default silently.
"""

from __future__ import annotations

import math
import os
from typing import Any

TREE_KEYS = ("tree_depth", "tree_top_k", "tree_total_tokens")


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum``; bools, floats, strings and None are refused (no silent conversion)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value}.")
    return int(value)


def is_auto(value: Any) -> bool:
    """Whether ``value`` spells ``"auto"`` (any case, surrounding whitespace ignored)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def tree_value(name: str, value: Any) -> int | str:
    """A tree-shape setting in canonical form: an int (``tree_total_tokens`` >= 2, others >= 1), or ``"auto"`` for
    ``tree_total_tokens``. 0, negative numbers, floats, bools and numeric strings are refused."""
    if name.endswith("total_tokens"):
        auto = name == "tree_total_tokens"
        if auto and is_auto(value):
            return "auto"
        if isinstance(value, str):
            raise ValueError(f"`{name}` must be an integer >= 2 (root included){' or auto' if auto else ''}, "
                             f"got {value!r}.")
        return positive_int(name, value, minimum=2)
    if isinstance(value, str):
        hint = " ('auto' is only accepted for tree_total_tokens)" if is_auto(value) else ""
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}{hint}.")
    return positive_int(name, value)


def tree_setting(config, name: str, default: Any) -> int | str:
    """``config.<name>`` checked with `tree_value`; only an unset value (None / absent) takes ``default``."""
    value = getattr(config, name, None)
    return tree_value(name, default if value is None else value)


def finite_number(name: str, value: Any, minimum: float | None = None, exclusive: bool = False) -> float:
    """A finite real number, optionally bounded below (``> minimum`` when ``exclusive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
    if minimum is not None and (value <= minimum if exclusive else value < minimum):
        raise ValueError(f"`{name}` must be {'>' if exclusive else '>='} {minimum}, got {value}.")
    return float(value)


# ---------------------------------------------------------------------------------------------------- paths
def looks_like_local_path(name: str) -> bool:
    """Whether ``name`` can only be meant as a local path, never a Hub id (``org/name``).

    True for absolute paths, ``./`` / ``../`` / ``~`` prefixes, backslashes, more than one ``/``, a trailing ``/``,
    and names whose first component is an existing local folder (``drafts/typo`` when ``drafts/`` exists).
    """
    name = str(name)
    if os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name or name.endswith("/"):
        return True
    parts = name.split("/")
    if len(parts) > 2:
        return True
    return len(parts) == 2 and os.path.isdir(parts[0])


def require_local_path(name, what: str = "folder") -> None:
    """Raise ``FileNotFoundError`` when ``name`` is meant as a local path (`looks_like_local_path`) but is missing,
    instead of letting it be tried as a Hub id."""
    name = str(name)
    if not name.strip():
        raise ValueError(f"an empty name was given as the {what}.")
    if not os.path.exists(os.path.expanduser(name)) and looks_like_local_path(name):
        raise FileNotFoundError(f"{name}: no such {what} (it is a local path, so it is not looked up on the Hub).")


def require_file(path, what: str = "file") -> None:
    """Raise ``FileNotFoundError`` naming ``path`` when it is not an existing file."""
    if not os.path.isfile(path):
        kind = "is a folder, not a file" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"{what} {path} {kind}.")


def check_writable(path) -> None:
    """Refuse an output file whose folder cannot be created or written (checked before any long run)."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.isdir(path):
        raise ValueError(f"output {path} is a folder; give a file name.")
    folder = os.path.dirname(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {path}: {folder} is a file, not a folder.")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"cannot write {path}: {folder} is not writable.")


def check_device(name, quantize: str | None = None) -> None:
    """Refuse a device this machine does not have (or int8 quantization, a CPU path, on another device) before
    any model is loaded."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but no CUDA GPU is available here; use --device cpu.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} does not exist: {torch.cuda.device_count()} GPU(s) are visible.")
    if quantize == "int8" and device.type != "cpu":
        raise ValueError("--quantize int8 is the lossless CPU path; use it with --device cpu (or drop it on a GPU).")
