"""Keep freed memory in the process for reuse, so training steps on CPUs stop paying page faults.

A training step allocates and frees the same large tensors every time (the `[M, V]` residual of the fused loss,
stored soft labels, activations). glibc's malloc serves blocks above its mmap threshold (dynamic, at most 32 MiB)
with fresh mappings and gives freed memory back to the kernel, so every step touches its large tensors' pages for
the first time again: about 54,000 page faults per batch of 8 sequences in a one-step draft's step on a 2-core
CPU, a fifth of the step. Raising the mmap and trim thresholds lets malloc keep that memory and hand it out again.

This changes the whole process's allocator, so it is never done on import: `poss train` does it, and
[`PosSTrainer`] when `PosSTrainingArguments.keep_freed_memory` is on (the default). The price is memory the process
keeps after a peak instead of returning it. Other C libraries (musl, macOS, Windows) are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import sys

from transformers.utils import logging

logger = logging.get_logger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap, which keeps freed memory for the next step
TRIM_THRESHOLD = (1 << 31) - 1  # return the heap's free top to the kernel only beyond 2 GiB


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Raise glibc malloc's mmap and trim thresholds for this process (once); returns whether it was done (False
    off Linux or without glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: other C libraries read these parameters differently
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if done:
        logger.debug("malloc keeps freed memory for reuse (mmap threshold 1 GiB, trim threshold 2 GiB): fewer page "
                    "faults per training step")
    return done
