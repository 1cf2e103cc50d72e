"""The text and JSON-lines files users hand to the library and the commands (question files, corpora, prompts,
conversations), plain or gzip-compressed: the project's own data files are ``.jsonl.gz``.

Compression is recognised by the file's first bytes, not its name. Errors name the file and the line and say what to
do: a line that is not UTF-8, a cut-off or damaged gzip file.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator

GZIP_MAGIC = b"\x1f\x8b"

__all__ = ["is_gzip", "data_suffix", "read_lines", "read_text"]


def is_gzip(path) -> bool:
    """Whether ``path`` starts like a gzip file (whatever its name)."""
    with open(path, "rb") as handle:
        return handle.read(2) == GZIP_MAGIC


def data_suffix(path) -> str:
    """The suffix that says what a data file holds, without a compression suffix (``a.jsonl.gz`` -> ``.jsonl``)."""
    name = os.path.basename(str(path)).lower()
    if name.endswith(".gz"):
        name = name[:-3]
    return os.path.splitext(name)[1]


def read_lines(path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file, gzip-compressed or not; each line keeps its ``"\\n"`` (a last
    line without one was cut off). Raises a ``ValueError`` naming the file and line for bytes that are not UTF-8 and
    for a damaged or truncated gzip file."""
    path = str(path)
    compressed = is_gzip(path)
    number = 0
    try:
        with (gzip.open(path, "rb") if compressed else open(path, "rb")) as handle:
            for number, raw in enumerate(handle, 1):
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                    raw = raw[3:]
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise ValueError(
                        f"{path}:{number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1}); "
                        "save the file as UTF-8."
                    ) from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise ValueError(f"{path}: cannot be read after line {number}: the gzip data is truncated or damaged "
                         f"({error}); write or download the file again.") from None


def read_text(path) -> str:
    """The whole text of a UTF-8 file, gzip-compressed or not (errors as in `read_lines`)."""
    return "".join(line for _, line in read_lines(path))
