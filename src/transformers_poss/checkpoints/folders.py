"""Output folders the library writes as a whole (`poss export`, `poss convert`): refused when they already hold files,
unless the caller asks to overwrite, and written so that a failure leaves them as they were.

The convention (docs/errors.md, "No overwrite without --overwrite"): a folder that does not exist or is empty is
written; a non-empty one is refused unless ``overwrite=True`` (``--overwrite``), and then only the files the writer
produces are replaced: every other file in the folder stays. The folder a draft was loaded from is never the output
of a conversion into another format (that would replace the draft itself).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

__all__ = ["check_output_folder", "staged_folder"]


def _same_folder(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_folder(path, overwrite: bool = False, source=None, what: str = "output folder",
                        allow_source: bool = False) -> Path:
    """Refuse ``path`` as an output folder when writing it could lose files; returns it as a `Path`.

    Args:
        path: the folder to write.
        overwrite: replace the writer's files in a non-empty folder (other files stay).
        source: the folder the written model was loaded from, if any: refused as the output (``allow_source`` False)
            because the written files would replace the model being read.
        allow_source: the writer produces the same model in the same format (a draft folder that also becomes a
            ``custom_generate`` repository), so its own folder is accepted with ``overwrite``.
    """
    path = Path(os.path.expanduser(str(path)))
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{what} {path} is a file; give a folder (new or empty).")
    if source is not None and os.path.isdir(str(source)) and _same_folder(path, source) and not allow_source:
        raise ValueError(f"{what} {path} is the folder the draft is read from; writing there would replace the draft. "
                         "Give another folder.")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        names = sorted(p.name for p in path.iterdir())
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise FileExistsError(f"{what} {path} is not empty (it holds {shown}); give a new or empty folder, or pass "
                              "--overwrite (overwrite=True) to replace the files this command writes (other files "
                              "stay).")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write {what} {path}: {parent} is not writable.")
    return path


def _move_into(source: Path, destination: Path) -> None:
    """Move every file under ``source`` to the same relative place under ``destination`` (``os.replace`` each)."""
    for item in source.iterdir():
        target = destination / item.name
        if item.is_dir() and not item.is_symlink():
            if target.exists() and not target.is_dir():
                target.unlink()
            target.mkdir(exist_ok=True)
            _move_into(item, target)
        else:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)


@contextmanager
def staged_folder(path):
    """Yield a fresh hidden folder inside ``path``; on success its files move up into ``path``, each with one
    ``os.replace``, so a file is never half-written and a model read from ``path`` keeps its old files open. On an
    error nothing in ``path`` changes (a folder this call created is removed again). Files of ``path`` that the
    block did not write stay; nothing is written outside ``path``."""
    path = Path(path)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=path))
    done = False
    try:
        yield staging
        _move_into(staging, path)
        done = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not done and not any(path.iterdir()):
            path.rmdir()
