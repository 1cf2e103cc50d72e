"""Whether bf16 mixed precision (autocast) pays for training on this machine.

On a GPU it is the hardware's support (``torch.cuda.is_bf16_supported``). On a CPU it is measured once per process:
a bf16 product of a draft layer's shape against the float32 one. CPUs with bf16 units (AVX-512 BF16, AMX) run it
several times faster; on the others bf16 is emulated and slower, so training stays in float32 there.
"""

from __future__ import annotations

import functools
import time

import torch

SPEEDUP_NEEDED = 1.5  # bf16 must beat float32 by this much to be chosen on a CPU


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup(rows: int = 512, hidden: int = 576, out: int = 1536, repeats: int = 10) -> float:
    """How many times faster a bf16 `[rows, hidden] x [hidden, out]` product runs than float32 here (best of
    ``repeats`` after three warm-up products; about 0.1 s once per process)."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, hidden, generator=generator), torch.randn(hidden, out, generator=generator)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        for _ in range(3):  # the first products build the kernels
            torch.mm(x, y)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def bf16_pays(device: str) -> tuple[bool, str]:
    """``(use bf16 autocast, why)`` for training on ``device`` ("cpu" or a CUDA device)."""
    if str(device).startswith("cuda"):
        supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return supported, "the GPU supports bf16" if supported else "the GPU has no bf16 support"
    speedup = cpu_bf16_speedup()
    verdict = speedup >= SPEEDUP_NEEDED
    return verdict, (f"a bf16 product measured {speedup:.1f}x float32 on this CPU "
                     f"({'>=' if verdict else '<'} {SPEEDUP_NEEDED}x needed)")
